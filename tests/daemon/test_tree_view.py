"""`ls`'s tree summary: bounded in entries, and it lets the event loop run while it walks."""

from __future__ import annotations

import asyncio

import numpy as np

from hicache.daemon.serve import tree_view
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.index.keys import Namespace, page_keys
from hicache.layout import KVLayout

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)


def service_with_branches(n: int) -> CacheService:
    svc = CacheService(HostTier(1 << 22, mlock=False))
    owner = object()
    rec = svc.register(owner, Namespace("m", LAYOUT), device_pages=4 * n)
    for i in range(n):  # n two-node branches: a 1-page root child, then a 1-page grandchild
        toks = np.array([i] * 4 + [7] * 4, dtype=np.int32)
        svc.insert(owner, rec.engine_id, page_keys(rec.ns.salt, toks[:4], 4), toks[:4], np.array([1 + 2 * i]))
        svc.insert(owner, rec.engine_id, page_keys(rec.ns.salt, toks, 4), toks, np.array([1 + 2 * i, 2 + 2 * i]))
    return svc


def test_the_summary_is_cut_at_max_nodes_and_counts_subtrees():
    svc = service_with_branches(50)
    full = asyncio.run(tree_view.tree_summary(svc.namespaces.values(), depth=2))["namespaces"][0]
    assert not full["truncated"] and len(full["tree"]) == 50
    assert all(n["subtree_nodes"] == 2 and len(n["children"]) == 1 for n in full["tree"])
    cut = asyncio.run(tree_view.tree_summary(svc.namespaces.values(), depth=2, max_nodes=31))["namespaces"][0]
    assert cut["truncated"]
    assert len(cut["tree"]) + sum(len(n["children"]) for n in cut["tree"]) == 31


def test_a_big_walk_yields_to_the_loop(monkeypatch):
    monkeypatch.setattr(tree_view, "YIELD_EVERY", 16)
    svc = service_with_branches(200)
    turns = 0

    async def scenario() -> None:
        nonlocal turns
        done = False

        async def other() -> None:  # another connection's work, wanting the loop
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        await tree_view.tree_summary(svc.namespaces.values(), depth=2)
        done = True
        await task

    asyncio.run(scenario())
    assert turns >= (400 + 400) // 16  # at least one turn per 16 nodes walked and per 16 listed
