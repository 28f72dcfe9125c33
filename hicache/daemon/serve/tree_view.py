"""The prefix trees as `hicache ls` shows them: paged, and yielding to the loop.

A tree can hold millions of nodes, so `ls` never walks one whole. A reply lists at
most `limit` entries: the root's children in order, each with its subtree down to
`depth` levels, then the next namespace. When the limit is reached the reply ends
after a whole top-level entry and carries `next`, the cursor the next call passes
as `after` (the namespace and the position of its next top-level entry); a single
entry whose subtree alone passes the limit is cut (`truncated`). The work per
reply is what it lists, and the walk yields to the loop every SLICE_S.

Entries carry what a node knows of itself (pages, tiers, hits, `child_count`), no
count of its subtree: that would walk everything below. The tree may change
between two turns of the walk or two pages: each node's children are taken as
they are when it is reached, and a page resumes at a position, so a concurrent
insert or eviction may repeat or skip a top-level entry. A slightly stale view,
never an error.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hicache.index.node import Tier, TreeNode

if TYPE_CHECKING:
    from hicache.daemon.core.service import NamespaceState

MAX_DEPTH = 64  # deeper `ls` requests are refused: the CLI shows 2 levels by default
# Entries in one `ls` reply: the reply is encoded on the event loop in one piece (~3 us an
# entry), so a page stays small and a listing takes more of them
DEFAULT_LIMIT = 1000
MAX_NODES = 5000  # the most `limit` may ask
SLICE_S = 0.002  # the longest the walk holds the event loop between two yields
CHECK_EVERY = 64  # entries listed between two looks at the clock


class _Walk:
    """Entries left to list in this reply; yields to the loop when its slice is up."""

    __slots__ = ("left", "listed", "slice_end")

    def __init__(self, left: int) -> None:
        self.left = left
        self.listed = 0
        self.slice_end = time.perf_counter() + SLICE_S

    async def tick(self) -> None:
        self.left -= 1
        self.listed += 1
        if self.listed % CHECK_EVERY == 0 and time.perf_counter() >= self.slice_end:
            await asyncio.sleep(0)
            self.slice_end = time.perf_counter() + SLICE_S


def _entry(node: TreeNode) -> dict:
    return {"pages": node.n_pages, "host": node.host is not None, "disk": node.on_disk,
            "engines": sorted(node.device), "hits": node.hit_count, "child_count": len(node.children)}


async def _subtree(node: TreeNode, depth: int, walk: _Walk) -> tuple[list[dict], bool]:
    """node's children down to `depth` levels, while entries are left; (them, cut)."""
    out: list[dict] = []
    if depth <= 0 or not node.children:
        return out, False
    # as they are now (the walk yields between entries), and no more than can be listed
    kids = tuple(itertools.islice(node.children.values(), max(0, walk.left)))
    for child in kids:
        if walk.left <= 0:
            return out, True
        e = _entry(child)
        await walk.tick()
        e["children"], cut = await _subtree(child, depth - 1, walk)
        out.append(e)
        if cut:
            return out, True
    return out, len(kids) < len(node.children)


async def tree_page(namespaces: Iterable[NamespaceState], depth: int, limit: int = DEFAULT_LIMIT,
                    after: tuple[str, int] | None = None) -> dict:
    """One page of the listing (module docstring). `after`: (namespace salt hex, index of its
    top-level entry to start at), as a previous page's `next` gave it."""
    out: list[dict] = []
    walk = _Walk(limit)
    nxt: dict | None = None
    spaces = list(namespaces)
    start_ns, start = after if after is not None else (None, 0)
    if start_ns is not None:
        skip = next((i for i, ns in enumerate(spaces) if ns.salt.hex() == start_ns), None)
        spaces = spaces[skip:] if skip is not None else []  # a namespace gone since: nothing left to list
    for ns in spaces:
        if walk.left <= 0:
            nxt = {"namespace": ns.salt.hex(), "index": 0}
            break
        first = start if ns.salt.hex() == start_ns else 0
        tree: list[dict] = []
        truncated = False
        index = first
        if depth > 0:
            top = ns.index.root.children
            for child in tuple(itertools.islice(top.values(), first, first + walk.left)):
                if walk.left <= 0:
                    break
                e = _entry(child)
                await walk.tick()
                e["children"], cut = await _subtree(child, depth - 1, walk)
                truncated |= cut
                tree.append(e)
                index += 1
            if index < len(top):  # the limit came first
                nxt = {"namespace": ns.salt.hex(), "index": index}
        out.append({"namespace": ns.salt.hex(), "model": ns.namespace.model,
                    "layout": ns.namespace.layout.to_dict(), "tp_rank": ns.namespace.tp_rank,
                    "page_bytes": ns.namespace.layout.page_bytes,
                    "pages": {name: ns.index.num_pages(t) for name, t in
                              (("device", Tier.DEVICE), ("host", Tier.HOST), ("disk", Tier.DISK))},
                    "root_children": len(ns.index.root.children), "first": first,
                    "tree": tree, "truncated": truncated})
        if nxt is not None:
            break
    return {"namespaces": out, "next": nxt}
