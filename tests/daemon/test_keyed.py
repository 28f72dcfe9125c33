"""Keyed pages (hicache/daemon/ingest/keyed.py) over a real daemon: pages an engine names itself,
kept as chains, reserved then committed, pinned while read, never leaked."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.keyed import KeyedPagesClient, named_page
from hicache.layout import KVLayout
from tests.wait import wait_until

LAYOUT = KVLayout("mha", 2, 8, "float16", num_kv_heads=2, head_dim=16)


def host_pages(sock: str) -> int:
    return RpcConnection.one_call(sock, "stats", None, timeout_s=5.0)["tiers"]["host"]["pages"]


def keyed(sock: str, model: str = "m") -> KeyedPagesClient:
    client = HiCacheClient(LAYOUT, 1, model=model, socket_path=sock)
    assert client.connect()
    return KeyedPagesClient(client)


def names(kc: KeyedPagesClient, *labels: str) -> tuple[list[bytes], np.ndarray]:
    pairs = [named_page(kc.client.salt, s.encode(), LAYOUT.page_size) for s in labels]
    return [k for k, _ in pairs], np.concatenate([t for _, t in pairs])


def write(kc: KeyedPagesClient, slot: int, fill: int) -> None:
    pb = LAYOUT.page_bytes
    kc.client.arena.array[slot * pb:(slot + 1) * pb] = fill


def read(kc: KeyedPagesClient, slot: int) -> bytes:
    pb = LAYOUT.page_bytes
    return bytes(kc.client.arena.array[slot * pb:(slot + 1) * pb])


def store(kc: KeyedPagesClient, labels: list[str], fill: int) -> int | None:
    keys, tokens = names(kc, *labels)
    r = kc.store(keys, tokens)
    assert r is not None and kc.mapped(r.host_pages)
    for slot in r.host_pages[r.host_pages >= 0].tolist():
        write(kc, slot, fill)
    return kc.store_done(r)


def test_store_then_another_engine_finds_and_reads_it(daemon):
    a, b = keyed(daemon.socket), keyed(daemon.socket)
    assert store(a, ["p0", "p1", "p2"], fill=7) == 3
    keys, _ = names(b, "p0", "p1", "p2", "p3")
    assert b.exists(keys) == 3 and b.exists(keys[1:]) == 2 and b.exists(keys[3:]) == 0
    f = b.fetch(keys)
    assert f is not None and (f.host_pages[:3] >= 0).all() and f.host_pages[3] == -1
    assert b.mapped(f.host_pages)
    assert all(read(b, s) == bytes([7]) * LAYOUT.page_bytes for s in f.host_pages[:3].tolist())
    b.release(f)
    assert store(a, ["p1", "p4"], fill=9) == 1  # p1 is stored already: only p4 is new
    assert host_pages(daemon.socket) == 4
    a.client.close()
    b.client.close()


def test_nothing_is_visible_before_store_done_and_a_failed_copy_frees_its_slots(daemon):
    a, b = keyed(daemon.socket), keyed(daemon.socket)
    keys, tokens = names(a, "x", "y")
    r = a.store(keys, tokens)
    assert r is not None and host_pages(daemon.socket) == 2
    assert b.exists(keys) == 0  # reserved, not stored: nobody may read half-copied bytes
    assert a.store_done(r, ok=False) == 0
    assert host_pages(daemon.socket) == 0 and b.exists(keys) == 0
    assert a.store_done(r) is None  # twice: refused, answered as "not stored"
    a.client.close()
    b.client.close()


def test_two_engines_racing_on_one_page_store_it_once(daemon):
    a, b = keyed(daemon.socket), keyed(daemon.socket)
    keys, tokens = names(a, "same")
    ra, rb = a.store(keys, tokens), b.store(keys, tokens)
    assert ra is not None and rb is not None and host_pages(daemon.socket) == 2
    write(a, int(ra.host_pages[0]), 1)
    write(b, int(rb.host_pages[0]), 1)
    assert a.store_done(ra) == 1 and b.store_done(rb) == 0  # the loser's slot goes back
    assert host_pages(daemon.socket) == 1
    a.client.close()
    b.client.close()


def test_a_vanished_engine_leaves_no_reserved_or_pinned_page(daemon):
    a = keyed(daemon.socket)
    assert store(a, ["kept"], fill=3) == 1
    keys, tokens = names(a, "lost1", "lost2")
    assert a.store(keys, tokens) is not None
    assert a.fetch(names(a, "kept")[0]) is not None  # pinned, never released
    assert host_pages(daemon.socket) == 3
    a.client.close()  # the connection drops: reservation freed, pin dropped
    wait_until(lambda: host_pages(daemon.socket) == 1, 30, "the reservation of a gone engine freed")
    b = keyed(daemon.socket)
    assert b.exists(names(b, "kept")[0]) == 1
    b.client.close()


def test_bad_requests_are_refused_and_answered_as_misses(daemon):
    a = keyed(daemon.socket)
    keys, tokens = names(a, "k")
    assert a.store(keys, tokens[:-1]) is None  # tokens of another page size: BAD_PARAMS
    assert a.client.refusals == 1
    with pytest.raises(ValueError, match="page_size"):
        named_page(a.client.salt, b"k", 2)
    a.client.close()


def test_a_stopped_daemon_is_a_miss_not_an_error(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    a = keyed(d.socket)
    d.kill9()
    keys, tokens = names(a, "k")
    assert a.exists(keys) == 0 and a.fetch(keys) is None and a.store(keys, tokens) is None
    a.client.close()


def test_an_engine_that_names_its_store_size_maps_that_room_when_it_connects(daemon_factory):
    """register's store_pages: the spare slabs are taken and mapped before the first store,
    whose copy then needs no map_slabs; they hold no page."""
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()  # 8 slabs of 1 MiB
    per_slab = (1 << 20) // LAYOUT.page_bytes
    client = HiCacheClient(LAYOUT, 1, model="m", socket_path=d.socket, store_pages=per_slab + 1)
    assert client.connect()
    a = KeyedPagesClient(client)
    assert a.client.arena.backed.sum() == 2  # room for per_slab + 1 pages: two slabs
    stats = RpcConnection.one_call(d.socket, "stats", None, timeout_s=5.0)["tiers"]["host"]
    assert stats["pages"] == 0 and stats["spare_slabs"] == 2
    keys, tokens = names(a, *[f"p{i}" for i in range(per_slab + 1)])
    version = a.client.slab_version
    r = a.store(keys, tokens)
    assert r is not None and a.mapped(r.host_pages) and a.client.slab_version == version  # nothing mapped
    for slot in r.host_pages.tolist():
        write(a, slot, 3)
    assert a.store_done(r) == per_slab + 1
    assert all(read(a, s) == bytes([3]) * LAYOUT.page_bytes for s in r.host_pages.tolist())
    a.client.close()


def test_spare_slabs_are_mapped_after_the_copy_and_a_stale_mapping_before_it(daemon_factory):
    """The daemon keeps room for a next store as large (spare slabs): once the engine maps
    the slabs a store's copy needs, it maps the new spares after the copy, so their
    pre-fault runs between stores; a slab it does not map at the daemon's generation is
    mapped before any copy into it."""
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()  # 8 slabs of 1 MiB
    a, b = keyed(d.socket), keyed(d.socket)
    per_slab = a.client.arena.slab_bytes // LAYOUT.page_bytes
    batch = per_slab + per_slab // 2  # a store over one and a half slabs
    assert store(a, [f"p{i}" for i in range(batch)], fill=4) == batch
    assert a.client.arena.backed.sum() == 3  # its two slabs and a spare, mapped with them
    stats = RpcConnection.one_call(d.socket, "stats", None, timeout_s=5.0)["tiers"]["host"]
    assert stats["pages"] == batch and stats["spare_slabs"] == 1
    keys, tokens = names(a, *[f"q{i}" for i in range(batch)])
    r = a.store(keys, tokens)  # into the room kept for it; two new spares taken
    assert r is not None and a.mapped(r.host_pages)
    assert a.client.arena.backed.sum() == 3  # the new spares are not mapped yet
    assert RpcConnection.one_call(d.socket, "stats", None, timeout_s=5.0)["tiers"]["host"]["spare_slabs"] == 2
    for slot in r.host_pages.tolist():
        write(a, slot, 5)
    assert a.store_done(r) == batch
    assert a.client.arena.backed.sum() == 5  # now they are, before the next store needs them
    a.client.arena.unmap_slab(int(np.flatnonzero(a.client.arena.backed)[-1]))  # not the daemon's mapping
    more = [f"r{i}" for i in range(batch)]
    assert store(a, more, fill=6) == batch  # store() checks the slots are mapped before writing
    keys, _ = names(b, *more)
    f = b.fetch(keys)
    assert f is not None and (f.host_pages >= 0).all()
    assert all(read(b, s) == bytes([6]) * LAYOUT.page_bytes for s in f.host_pages.tolist())
    b.release(f)
    a.client.close()
    b.client.close()
