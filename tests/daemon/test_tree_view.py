"""`ls`'s tree pages: bounded in entries, continued by a cursor, and the event loop runs while it walks."""

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


def page(svc: CacheService, depth: int = 2, limit: int = tree_view.DEFAULT_LIMIT, after=None) -> dict:
    return asyncio.run(tree_view.tree_page(svc.namespaces.values(), depth, limit, after))


def test_a_page_lists_whole_top_level_entries_and_the_cursor_continues_after_them():
    svc = service_with_branches(50)
    full = page(svc)
    (ns,) = full["namespaces"]
    assert full["next"] is None and not ns["truncated"] and len(ns["tree"]) == 50
    assert all(n["child_count"] == 1 and len(n["children"]) == 1 for n in ns["tree"])
    # 31 entries: 15 branches of 2, then the 16th's first entry... which ends the page
    first = page(svc, limit=31)
    (ns1,) = first["namespaces"]
    assert len(ns1["tree"]) + sum(len(n["children"]) for n in ns1["tree"]) == 31
    assert first["next"] == {"namespace": ns["namespace"], "index": 16}
    rest = page(svc, after=(first["next"]["namespace"], first["next"]["index"]))
    (ns2,) = rest["namespaces"]
    assert rest["next"] is None and ns2["first"] == 16 and len(ns2["tree"]) == 34
    assert [n["pages"] for n in ns1["tree"][:16] + ns2["tree"]] == [n["pages"] for n in ns["tree"]]


def test_an_entry_whose_subtree_passes_the_limit_is_cut():
    svc = service_with_branches(3)
    one = page(svc, depth=2, limit=1)
    (ns,) = one["namespaces"]
    assert ns["truncated"] and len(ns["tree"]) == 1 and ns["tree"][0]["children"] == []
    assert one["next"] == {"namespace": ns["namespace"], "index": 1}


def test_a_big_walk_yields_to_the_loop(monkeypatch):
    monkeypatch.setattr(tree_view, "SLICE_S", 0.0)  # every look at the clock yields
    monkeypatch.setattr(tree_view, "CHECK_EVERY", 16)
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
        await tree_view.tree_page(svc.namespaces.values(), depth=2)
        done = True
        await task

    asyncio.run(scenario())
    assert turns >= 400 // 16  # at least one turn per 16 entries listed
