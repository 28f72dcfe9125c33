"""hicache.index: what the daemon knows of the pages of each namespace.

keys.py (chained page keys, namespaces), node.py (TreeNode, results, input checks),
radix.py (RadixIndex: the tree, match, insert, residency, locks), tree_walk.py (the
tree's shape: key search, split, paths), eviction.py (RadixIndex's eviction calls),
policy.py (eviction order, candidate heaps, residency ledger), key_map.py (keyed
chains), pins.py and priorities.py (retention hints), admission.py (disk admission),
checkpoints.py (hybrid models' state checkpoints), restore.py (the tree's disk part rebuilt
from page records after a restart). The C of native_index.py: native_index.c (the walk and the
locks), native_sketch.c (admission's sketch), native_restore.c (the restore's check and chaining).

locks.py (Locks over a RadixIndex: a ref per tier on a node and all its ancestors).
"""
