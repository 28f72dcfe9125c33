"""The tree-shape steps RadixIndex (hicache/index/radix.py) and its neighbours walk with:
the key search inside a node, a node's split, match's walk, the path to the root, a
preorder and the chain of nodes ending a path. They change no residency and no lock
counts (match's walk sets the access time and hit count of what it passes): a split
keeps both halves' residency and locks, so the ledger (policy.py) has nothing to do."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.index.keys import KEY_BYTES, PackedKeys
from hicache.index.node import NO_ENTRIES, IndexInputError, IndexStateError, TreeNode


def common_pages(node_keys: list[bytes], keys: list[bytes], start: int) -> int:
    """How many leading pages of `node_keys` equal `keys[start:]`, given that the
    first does. Chained keys make equality monotone: binary search."""
    m = min(len(node_keys), len(keys) - start)
    if node_keys[m - 1] == keys[start + m - 1]:
        return m
    lo, hi = 1, m - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if node_keys[mid - 1] == keys[start + mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def split_node(node: TreeNode, j: int, page_size: int) -> TreeNode:
    """Split `node` after its first j pages; return the new upper node."""
    ps = page_size
    keys = node.keys
    lanes = node.lanes()
    upper = TreeNode(
        parent=node.parent, children={keys[j]: node}, keys=keys[:j], tokens=node.tokens[:j * ps],
        device={e: a[:j] for e, a in node.device.items()} if node.device else NO_ENTRIES,
        host=None if node.host is None else node.host[:j], on_disk=node.on_disk,
        lock_ref=node.lock_ref.copy(), last_access=node.last_access, hit_count=node.hit_count,
        device_locks=dict(node.device_locks) if node.device_locks else NO_ENTRIES,
        child_lanes=dict.fromkeys(lanes, 1) if lanes else NO_ENTRIES)
    # Same residency as the lower half: the parent's child_lanes and the page counts
    # are unchanged, and the upper half is no candidate while the lower one is below it.
    node.parent.children[keys[0]] = upper
    node.parent = upper
    node.keys = keys[j:]
    node.tokens = node.tokens[j * ps:]
    if node.device:
        node.device = {e: a[j:] for e, a in node.device.items()}
    if node.host is not None:
        node.host = node.host[j:]
    return upper


def check_live(node: object) -> None:
    if not isinstance(node, TreeNode) or node.is_root:
        raise IndexInputError("expected a non-root TreeNode")
    if node.removed:
        raise IndexStateError(f"{node!r} was removed from the index")


def path_to_root(node: object, root: TreeNode) -> list[TreeNode]:
    """`node` and its ancestors, root excluded; checks the node is live and under `root`."""
    if type(node) is not TreeNode or node.removed or not node.keys:
        check_live(node)  # raises, or passes a subclass
    path = [node]
    x = node.parent
    while x is not root:  # every unlock walks this: kept to one test per node
        if x is None:
            raise IndexStateError(f"{node!r} belongs to another index")
        path.append(x)
        x = x.parent
    return path


def preorder(root: TreeNode) -> list[TreeNode]:
    """Every node below `root`, parents before children."""
    out: list[TreeNode] = []
    stack = list(root.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def suffix_chain(path: list[TreeNode], num_pages: int, node: TreeNode) -> list[TreeNode]:
    """Nodes from `node` upwards (`path`: its path_to_root) covering its path's last
    num_pages pages (the top one may stick out above them). Raises before any change
    if the path is shorter."""
    chain: list[TreeNode] = []
    need = num_pages
    for x in path:
        if need <= 0:
            break
        chain.append(x)
        need -= len(x.keys)
    if need > 0:
        raise IndexInputError(f"{num_pages} pages exceed the path ending at {node!r}")
    return chain


def walk_path(root: TreeNode, keys: Sequence[bytes], lane: int, seg: int, now: float,
              page_size: int) -> tuple[list[TreeNode], int, int]:
    """RadixIndex.match's walk in Python (native_index.py is the same in C): the path from
    `root`, and how many of its nodes are on `lane`'s device, then in host (`seg`: the
    segment it starts in); splits the node where it ends inside one."""
    node = root
    n = len(keys)
    i = 0
    n_dev = n_host = 0
    path: list[TreeNode] = []
    # Keys off the wire: sliced from the blob here, not through PackedKeys.__getitem__
    # (a Python call per key looked at; the walk looks at two per node).
    blob = keys.blob if type(keys) is PackedKeys else None
    while i < n:
        child = node.children.get(keys[i] if blob is None else blob[i * KEY_BYTES:(i + 1) * KEY_BYTES])
        if child is None:
            break
        if seg == 0 and lane in child.device:
            n_dev += 1
        elif seg <= 1 and child.host is not None:
            seg = 1
            n_host += 1
        elif child.on_disk or child.host is not None:
            seg = 2
        else:
            break
        ck = child.keys
        m = len(ck)
        end = i + m
        if end <= n and ck[m - 1] == (keys[end - 1] if blob is None else
                                      blob[(end - 1) * KEY_BYTES:end * KEY_BYTES]):
            j = m
        else:
            j = common_pages(ck, keys, i)
            if j < m:
                child = split_node(child, j, page_size)
        child.last_access = now
        child.hit_count += 1
        path.append(child)
        i += j
        if j < m:
            break  # diverged or ended inside the node
        node = child
    return path, n_dev, n_host
