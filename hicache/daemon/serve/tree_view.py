"""The prefix trees as `hicache ls` shows them: bounded, and yielding to the loop.

A tree can hold a million nodes; walking it in one go would hold the event loop
(and every engine) for a second. The walk yields every YIELD_EVERY nodes, lists
at most `max_nodes` entries per reply (the rest is cut, with `truncated` set),
and takes each node's children as they were when it was reached, so a tree
changing between two turns gives a slightly stale view, never an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hicache.index.node import Tier, TreeNode

if TYPE_CHECKING:
    from hicache.daemon.core.service import NamespaceState

YIELD_EVERY = 2048  # nodes visited (or listed) between two returns to the event loop
MAX_DEPTH = 64  # deeper `ls` requests are refused: the CLI shows 2 levels by default
MAX_NODES = 20000  # entries in one `ls` reply; past them the listing is cut


async def tree_summary(namespaces: Iterable[NamespaceState], depth: int, max_nodes: int = MAX_NODES) -> dict:
    out = []
    budget = _Budget(max_nodes)
    for ns in list(namespaces):
        kids, sizes = await _walk(ns.index.root)
        tree, truncated = await _summarize(ns.index.root, kids, sizes, depth, budget)
        out.append({"namespace": ns.salt.hex(), "model": ns.namespace.model,
                    "layout": ns.namespace.layout.to_dict(), "tp_rank": ns.namespace.tp_rank,
                    "page_bytes": ns.namespace.layout.page_bytes,
                    "pages": {name: ns.index.num_pages(t) for name, t in
                              (("device", Tier.DEVICE), ("host", Tier.HOST), ("disk", Tier.DISK))},
                    "tree": tree, "truncated": truncated})
        await asyncio.sleep(0)
    return {"namespaces": out}


async def _walk(root: TreeNode) -> tuple[dict[TreeNode, tuple[TreeNode, ...]], dict[TreeNode, int]]:
    """Each node's children (as seen) and subtree size, in slices between loop turns."""
    kids: dict[TreeNode, tuple[TreeNode, ...]] = {}
    order: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        children = tuple(node.children.values()) if node.children else ()  # leaves allocate nothing
        kids[node] = children
        order.append(node)
        stack.extend(children)
        if len(order) % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    sizes: dict[TreeNode, int] = {}
    for i, node in enumerate(reversed(order), 1):  # children come after their parent in `order`
        sizes[node] = 1 + sum(sizes[c] for c in kids[node])
        if i % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    return kids, sizes


class _Budget:
    """Entries left to list, shared down the recursion; counts out loop turns too."""

    __slots__ = ("left", "listed")

    def __init__(self, left: int) -> None:
        self.left = left
        self.listed = 0


async def _summarize(node: TreeNode, kids: dict[TreeNode, tuple[TreeNode, ...]], sizes: dict[TreeNode, int],
                     depth: int, budget: _Budget) -> tuple[list[dict], bool]:
    if depth <= 0:
        return [], False
    out: list[dict] = []
    truncated = False
    for child in kids[node]:
        if budget.left <= 0:
            return out, True
        budget.left -= 1
        budget.listed += 1
        if budget.listed % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        below, cut = await _summarize(child, kids, sizes, depth - 1, budget)
        truncated |= cut
        out.append({"pages": child.n_pages, "host": child.host is not None, "disk": child.on_disk,
                    "engines": sorted(child.device), "hits": child.hit_count,
                    "subtree_nodes": sizes[child], "children": below})
    return out, truncated
