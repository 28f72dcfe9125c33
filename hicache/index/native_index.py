"""The radix index's hot loops in C, over the index's own TreeNode objects: the walk of
RadixIndex.match and the lock and unlock loops of a match's segments.

Why: each is a few dict lookups, key comparisons and counter updates per node, on the
path every engine request waits on (match, then release); in Python each step is an
interpreter round and the calls around them cost more than the steps. The C loops do
the same steps through the CPython C API on the same objects (the C and what each
function mirrors: native_index.c): there is no second copy of the tree that could
drift from it.

`walk(root, blob, lane, seg, now)` walks from `root` along the packed 16-byte page keys
in `blob` as tree_walk.walk_path does (same segment rules, same key comparisons,
`last_access = now` and `hit_count += 1` on every node it passes) and returns `(path,
n_dev, n_host, j)`. When the request diverges or ends inside the last node of `path`,
that node is left untouched and `j` is the number of its pages that match: the caller
splits it there and touches the upper part (the split stays Python's, split_node).
Otherwise `j` is -1.

The extension `hicache.index._native_index` is compiled from native_index.c by the build
(setup.py; loaded by hicache/kernels/native_build.py, the daemon loads it at startup).
Where it was not built (an sdist installed without a C compiler), or with
`HICACHE_NATIVE_INDEX=0`, `load()` returns None and the index runs the same loops in
Python (tests/index/test_native_index.py runs both on random trees).
"""

from __future__ import annotations

from hicache.kernels import native_build

EXTENSION = native_build.NativeModule("hicache.index._native_index", "HICACHE_NATIVE_INDEX",
                                      "running the index's loops in Python")
load = EXTENSION.load  # the compiled loops, or None where they were not built
unavailable_reason = EXTENSION.unavailable_reason
