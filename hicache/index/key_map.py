"""A key -> node map for indexes whose pages are asked about mid-path.

SGLang asks its storage about pages by key, starting anywhere in a prefix: a
walk from the root cannot answer for a page whose path it has not seen the
start of. Keyed namespaces therefore keep every key's node here, so `exists`
and `fetch` stay one dict lookup per key while the pages form chains in the
radix tree (leaf-first eviction sees the prefix structure).

Kept cheap on purpose: only new nodes are added (RadixIndex._insert_from).
A split keeps the node object with the *lower* half, so a key whose page moved
to the new upper half is found by walking up from the node it was filed
under; a removed node is noticed on lookup (and by the occasional prune), so
eviction never has to tell the map.
"""

from __future__ import annotations

from hicache.index.node import TreeNode

PRUNE_SLACK = 4096  # entries beyond twice the live ones before a prune pass


class KeyMap:
    __slots__ = ("_nodes", "_prune_at")

    def __init__(self) -> None:
        self._nodes: dict[bytes, TreeNode] = {}
        self._prune_at = PRUNE_SLACK

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, node: TreeNode) -> None:
        nodes = self._nodes
        for key in node.keys:
            nodes[key] = node
        if len(nodes) > self._prune_at:
            self.prune()

    def find(self, key: bytes) -> TreeNode | None:
        """The live node holding `key`'s page, or None."""
        node = self._nodes.get(key)
        if node is None:
            return None
        x: TreeNode | None = node
        while x is not None and not x.removed and key not in x.keys:
            x = x.parent  # split off into an upper half (the root holds no keys: ends at None)
        if x is None or x.removed:
            del self._nodes[key]
            return None
        if x is not node:
            self._nodes[key] = x
        return x

    def prune(self) -> None:
        """Drop the entries of removed nodes (amortised: runs as the map doubles)."""
        self._nodes = {k: n for k, n in self._nodes.items() if not n.removed}
        self._prune_at = 2 * len(self._nodes) + PRUNE_SLACK
