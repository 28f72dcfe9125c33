"""Tenants share the daemon's host arena but see nothing of each other's: each engine
maps only the slabs holding its own namespace's pages, slab fds are sealed, and a
slab that moves to another namespace is never visible through an old mapping.
Real daemon, real engines (EngineCache over CPU pools), bytes checked end to end."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hicache.client.client import HiCacheClient
from hicache.client.engine_cache import EngineCache
from hicache.errors import ClientError
from hicache.layout import KVLayout
from hicache.rpc.framing import pack_frame
from tests.rpc.wire import unread_bytes
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool
from tests.daemon.engine_worker import check_pages, write_pages

LAYOUT = KVLayout("mha", num_layers=4, page_size=16, dtype="float16", num_kv_heads=4, head_dim=64)  # 64 KiB pages
PER_SLAB = (1 << 20) // LAYOUT.page_bytes  # the daemon's slabs are 1 MiB at these capacities


def engine(socket: str, tenant: str, pool_pages: int = 64) -> EngineCache:
    pool = DevicePool(LAYOUT, num_slots=pool_pages * LAYOUT.page_size)
    client = HiCacheClient(LAYOUT, pool.num_pages, model="m", extra_key=tenant, socket_path=socket, timeout_s=10.0)
    return EngineCache(client, pool, PagedTokenToKVPoolAllocator(pool.num_slots, LAYOUT.page_size))


def tokens(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, pages * LAYOUT.page_size, dtype=np.int32)


def store(cache: EngineCache, toks: np.ndarray) -> None:
    prefix = cache.lookup(toks)
    cache.finish_load(prefix)
    new = cache.alloc_pages(len(toks) // LAYOUT.page_size - prefix.num_pages)
    write_pages(cache.pool, cache.client.page_keys(toks)[prefix.num_pages:], new)
    cache.store(prefix, toks, new)
    cache.release(prefix)
    deadline = time.monotonic() + 30
    while cache.backups:
        assert time.monotonic() < deadline, "backups did not finish"
        cache.poll()
        time.sleep(0.002)


def host_slots(cache: EngineCache, toks: np.ndarray) -> np.ndarray:
    """Where the daemon holds these pages on host (evicting our device copies first)."""
    cache.evict(cache.pool.num_pages)
    m = cache.client.match(toks)
    cache.client.release(m)
    return m.host_pages


def load_exact(cache: EngineCache, toks: np.ndarray) -> int:
    """Pages of `toks` loaded back from host, each checked byte for byte."""
    cache.evict(cache.pool.num_pages)
    prefix = cache.lookup(toks)
    for layer in range(LAYOUT.num_layers):
        prefix.wait_layer(layer)
    cache.finish_load(prefix)
    keys = cache.client.page_keys(toks)
    assert check_pages(cache.pool, keys[:prefix.num_pages], prefix.device_pages) == 0, "KV came back changed"
    n = int(prefix.match.host_len)
    cache.release(prefix)
    return n


@pytest.fixture
def hostd(daemon_factory):
    return daemon_factory("--host-capacity", "8MiB", "--no-disk").start()


def test_each_tenant_maps_only_the_slabs_of_its_own_namespace(hostd):
    a, b = engine(hostd.socket, "tenant-a"), engine(hostd.socket, "tenant-b")
    ta, tb = tokens(1, 24), tokens(2, 8)
    store(a, ta)
    store(b, tb)
    slots_a, slots_b = host_slots(a, ta), host_slots(b, tb)
    assert len(slots_a) == 24 and len(slots_b) == 8
    assert not a.arena.backed[b.arena.backed].any(), "two tenants map a common slab"
    assert a.arena.covers(slots_a, LAYOUT.page_bytes) and not b.arena.covers(slots_a[:1], LAYOUT.page_bytes)
    # Nothing of a's KV anywhere in what b can read.
    page_a = bytes(a.arena.array[slots_a[0] * LAYOUT.page_bytes:(slots_a[0] + 1) * LAYOUT.page_bytes])
    for slab in np.flatnonzero(b.arena.backed):
        mem = bytes(b.arena.array[slab * b.arena.slab_bytes:(slab + 1) * b.arena.slab_bytes])
        assert page_a[:4096] not in mem
    # b cannot ask for a's slabs: engine ids belong to their connection.
    with pytest.raises(ClientError, match="NOT_REGISTERED"):
        b.client.conn.call("map_slabs", {"engine": a.client.engine_id, "have": []})
    assert load_exact(a, ta) == 24 and load_exact(b, tb) == 8
    a.close()
    b.close()


def test_slab_fds_engines_receive_cannot_be_resized_and_the_daemon_survives_trying(hostd):
    a = engine(hostd.socket, "tenant-a")
    ta = tokens(3, 20)
    store(a, ta)
    fds: list[int] = []
    a.client.conn.call("map_slabs", {"engine": a.client.engine_id, "have": []}, fds=fds)
    assert len(fds) == 3  # 20 pages of 64 KiB: two 1 MiB slabs, and a spare for a next store as large
    for fd in fds:
        for size in (0, 4096, 1 << 30):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)  # sealed: SIGBUS in the daemon is impossible
        os.close(fd)
    assert load_exact(a, ta) == 20  # the daemon is alive and the bytes are whole
    assert hostd.running
    a.close()


def test_a_slab_taken_from_one_tenant_is_invisible_to_its_old_mapping(hostd):
    a, b = engine(hostd.socket, "tenant-a"), engine(hostd.socket, "tenant-b")
    seqs = [tokens(10 + i, PER_SLAB // 2) for i in range(16)]  # 8 slabs' worth: the whole arena
    for toks in seqs:
        store(a, toks)
    slabs_before = np.flatnonzero(a.arena.backed)
    assert len(slabs_before) == 8
    page_a = {int(s): bytes(a.arena.array[s * (1 << 20):s * (1 << 20) + 4096]) for s in slabs_before}
    tb = tokens(99, 8)
    store(b, tb)  # the arena is full: a, with the oldest pages, gives up a slab
    taken = [s for s in slabs_before if b.arena.backed[s]]
    assert len(taken) == 1, "b should have got exactly one of a's slabs"
    slab = int(taken[0])
    assert a.arena.backed[slab]  # a has not heard of it yet: its old mapping is still there...
    old = bytes(a.arena.array[slab * (1 << 20):(slab + 1) * (1 << 20)])
    assert not any(old), "...and reads zeros, never b's pages (nor a's old ones)"
    assert page_a[slab] not in bytes(b.arena.array[slab * (1 << 20):(slab + 1) * (1 << 20)])
    assert load_exact(b, tb) == 8
    # a's newest sequences are still whole; a new store maps a's current slabs again
    assert sum(load_exact(a, toks) for toks in seqs[-4:]) == 4 * (PER_SLAB // 2)
    tn = tokens(500, 4)
    store(a, tn)
    assert load_exact(a, tn) == 4
    a.close()
    b.close()


def test_a_client_that_asks_for_slab_fds_without_reading_gets_one_message_of_them(hostd):
    """At most one message of descriptors is in flight per connection: asking again and
    again without reading must not pile descriptors up in the daemon's user's account."""
    a = engine(hostd.socket, "tenant-a")
    store(a, tokens(4, 20))
    sock = a.client.conn.sock
    n = 40
    for i in range(n):
        sock.sendall(pack_frame({"id": 10_000 + i, "method": "map_slabs",
                                 "params": {"engine": a.client.engine_id, "have": []}}))
    # Let the daemon answer all of them while we read nothing: wait for our receive
    # queue to stop growing (a condition with a deadline; reading would let another
    # descriptor message through, rightly).
    deadline, last, since = time.monotonic() + 60, -1, time.monotonic()
    while time.monotonic() - since < 1.0:
        assert time.monotonic() < deadline, "the daemon did not answer"
        now = unread_bytes(sock)
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.01)
    fds: list[int] = []
    replies = [a.client.conn._read_message(fds=fds) for _ in range(n)]
    assert sorted(r["id"] for r in replies) == list(range(10_000, 10_000 + n))
    with_fds = [r for r in replies if "result" in r and r["result"]["sent"]]
    assert len(with_fds) == 1 and len(fds) == len(with_fds[0]["result"]["sent"]) == 3
    assert all(r["error"]["code"] == "BUSY" for r in replies if r is not with_fds[0])
    for fd in fds:
        os.close(fd)
    assert load_exact(a, tokens(4, 20)) == 20
    a.close()
