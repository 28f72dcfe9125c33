"""Host slabs owned by one namespace each: the shared budget moves between
namespaces a whole slab at a time (compacting where it can), and a slab that
changes owner is never visible to the old owner's mappings."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.index.keys import Namespace
from hicache.index.node import Tier
from hicache.layout import KVLayout
from hicache.tiers.host.arena import SEALS, HostArena
from tests.daemon.test_service import Clock, seq

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)  # 256 B pages
PB = LAYOUT.page_bytes


def pattern(key: bytes) -> np.ndarray:
    """What an engine's backup would have written for the page with this key."""
    return np.frombuffer((key * (PB // len(key) + 1))[:PB], dtype=np.uint8)


class Tenants:
    """Two namespaces on one 4-slab host tier; pages are 'backed up' by writing a
    pattern derived from their key into their host slots."""

    def __init__(self) -> None:
        self.svc = CacheService(HostTier(4 << 20, mlock=False), clock=Clock())
        self.per_slab = self.svc.host.slab_bytes // PB
        self.owners = {"a": object(), "b": object()}
        self.recs = {n: self.svc.register(o, Namespace(n, LAYOUT), device_pages=1 << 16)
                     for n, o in self.owners.items()}
        self.seqs: dict[str, list[list[bytes]]] = {"a": [], "b": []}
        self.next_dev = {"a": 1, "b": 1}

    def insert(self, name: str, seed: int, pages: int) -> np.ndarray | None:
        rec, owner = self.recs[name], self.owners[name]
        keys, toks = seq(seed, pages, rec.ns.salt)
        dev = np.arange(self.next_dev[name], self.next_dev[name] + pages)
        self.next_dev[name] += pages
        _, _, bk = self.svc.insert(owner, rec.engine_id, keys, toks, dev)
        if bk is None:
            return None
        arena = self.svc.host.arena.array
        for key, slot in zip(keys, bk.host_pages):
            arena[slot * PB:(slot + 1) * PB] = pattern(key)
        self.svc.backup_done(owner, bk.backup_id, ok=True)
        self.svc.evict_device(owner, rec.engine_id, pages)  # host only from now on
        self.seqs[name].append(keys)
        return bk.host_pages

    def touch(self, name: str, keys: list[bytes]) -> None:
        pin = self.svc.match(self.owners[name], self.recs[name].engine_id, keys)
        self.svc.release(self.owners[name], pin.pin_id)

    def check_bytes(self, name: str, keys: list[bytes]) -> int:
        """Pages of `keys` on host, each checked against its pattern."""
        pin = self.svc.match(self.owners[name], self.recs[name].engine_id, keys)
        arena = self.svc.host.arena.array
        for key, slot in zip(keys, pin.host_pages):
            assert (arena[slot * PB:(slot + 1) * PB] == pattern(key)).all(), "a moved page lost its bytes"
        n = pin.host_len
        self.svc.release(self.owners[name], pin.pin_id)
        return n


def fill_scattered(t: Tenants) -> None:
    """a: two slabs, each half full of pages it touched recently; b: the other two slabs."""
    half = t.per_slab // 2
    for i in range(8):  # 8 sequences of half a slab's pages / 2 = two slabs of a's
        t.insert("a", 100 + i, half // 2)
    for keys in t.seqs["a"][1::2]:
        t.touch("a", keys)  # the odd ones are recent, the even ones the oldest pages of all
    for i in range(2):
        t.insert("b", 200 + i, t.per_slab)
    assert t.svc.host.free_slabs == 0
    page_bytes = sum(len(k) for k in t.seqs["a"][0::2]) * PB
    assert t.svc.evict_tier(Tier.HOST, page_bytes) == page_bytes  # a's even sequences go
    assert t.svc.host.owner_of.count(t.recs["a"].ns.salt) == 2  # still two slabs, each half full


def test_a_slab_is_compacted_out_of_the_oldest_namespace_without_losing_a_page():
    t = Tenants()
    fill_scattered(t)
    a_salt = t.recs["a"].ns.salt
    kept = sum(len(k) for k in t.seqs["a"][1::2])
    assert t.svc.counters.slabs_reclaimed == 0
    reassigned = t.svc.host.slabs_reassigned  # b got a's spare slab while filling
    a_class = t.recs["a"].ns.page_class
    a_spare = a_class.spare_pages
    got = t.insert("b", 300, 8)  # no free slab: a has the oldest pages, and room to pack them
    assert got is not None and len(got) == 8
    assert t.svc.counters.slabs_reclaimed == 1
    assert a_class.spare_pages == a_spare  # moving a's pages is no store of a's: no new spare target
    assert t.svc.host.owner_of.count(a_salt) == 1 and t.svc.host.owner_of.count(t.recs["b"].ns.salt) == 3
    assert sum(t.check_bytes("a", k) for k in t.seqs["a"][1::2]) == kept  # every page moved, bytes intact
    assert t.svc.host.slabs_reassigned == reassigned + 1


def test_pinned_pages_keep_their_slab_and_the_requester_evicts_its_own():
    t = Tenants()
    fill_scattered(t)
    a = t.recs["a"]
    pins = [t.svc.match(t.owners["a"], a.engine_id, keys) for keys in t.seqs["a"][1::2]]  # in use: unmovable
    assert all(p.host_len for p in pins)
    got = t.insert("b", 300, 8)
    assert got is not None and len(got) == 8  # b made room among its own pages
    assert t.svc.counters.slabs_reclaimed == 0
    assert t.svc.host.owner_of.count(a.ns.salt) == 2
    b_pages = t.recs["b"].ns.index.num_pages(Tier.HOST)
    assert b_pages < 2 * t.per_slab + 8
    for p in pins:
        t.svc.release(t.owners["a"], p.pin_id)
    assert sum(t.check_bytes("a", k) for k in t.seqs["a"][1::2]) == sum(len(k) for k in t.seqs["a"][1::2])


def test_slab_versions_and_owners_tell_engines_what_to_map():
    t = Tenants()
    host, a, b = t.svc.host, t.recs["a"].ns.salt, t.recs["b"].ns.salt
    assert host.slab_version(a) == 0 and host.slabs_of(a) == []
    t.insert("a", 1, 8)
    assert host.slab_version(a) == 1 and [s for s, _ in host.slabs_of(a)] == [host.owner_of.index(a)]
    t.insert("b", 2, 8)
    assert set(s for s, _ in host.slabs_of(a)).isdisjoint(s for s, _ in host.slabs_of(b))


def test_a_slab_changing_owner_is_punched_out_and_backed_anew():
    host = HostTier(4 << 20, mlock=False)
    a = host.page_class(b"a" * 16, PB)
    b = host.page_class(b"b" * 16, PB)
    ids = a.alloc(2 * host.slab_bytes // PB)  # two slabs
    # an engine of a maps them from the fds the daemon sends it
    engine_a = HostArena.reserve(host.num_slabs, host.slab_bytes)
    for slab, gen in host.slabs_of(b"a" * 16):
        engine_a.map_slab(slab, os.dup(host.arena.slab_fd(slab)), gen)
        host.arena.array[slab * host.slab_bytes:(slab + 1) * host.slab_bytes] = 0xAA
    a.free(ids)  # slabs go back; a keeps one warm (its spare)
    old = {s: g for s, g in enumerate(host.arena._gens) if host.owner_of[s] is None and engine_a.backed[s]}
    assert old and len(host.slabs_of(b"a" * 16)) == 1
    views = {s: engine_a.array[s * host.slab_bytes:(s + 1) * host.slab_bytes] for s in old}
    assert all((v == 0xAA).all() for v in views.values())
    for _ in range(host.free_slabs - len(old)):  # b takes the clean slabs first ...
        assert b.alloc(host.slab_bytes // PB) is not None
    assert all(host.arena.slab_gen(s) == g and host.owner_of[s] is None for s, g in old.items())
    assert b.alloc(1) is not None  # ... and only then one of a's old ones, backed anew
    slab, = [s for s in old if host.owner_of[s] == b"b" * 16]
    assert host.arena.slab_gen(slab) == old[slab] + 1
    assert host.slabs_reassigned == 1
    host.arena.array[slab * host.slab_bytes:(slab + 1) * host.slab_bytes] = 0xBB
    assert not views[slab].any(), "a's old mapping must read zeros, never b's bytes"
    engine_a.close()
    host.close()


def test_a_returning_owner_gets_its_own_slab_back_unchanged():
    host = HostTier(4 << 20, mlock=False)
    a = host.page_class(b"a" * 16, PB)
    first = a.alloc(host.slab_bytes // PB + 1)  # two slabs
    a.free(first)  # one goes back (a keeps one warm)
    assert host.free_slabs == host.num_slabs - 1
    gens = [host.arena.slab_gen(s) for s in range(host.num_slabs)]
    a.alloc(host.slab_bytes // PB + 1)
    assert [host.arena.slab_gen(s) for s in range(host.num_slabs)] == gens  # no remap for a's engines
    assert host.slabs_reassigned == 0
    host.close()


def test_slab_fds_are_sealed_against_resizing():
    host = HostTier(4 << 20, mlock=False)
    fd = host.arena.slab_fd(0)
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    for size in (0, host.slab_bytes // 2, host.slab_bytes * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed seals: no more changes
    host.arena.array[:] = 1  # the daemon's mapping is whole
    host.close()


def test_pages_over_half_a_slab_are_refused_with_what_to_do():
    """A 700 KiB page fits a 1 MiB slab once, but the next slab's first whole page would
    start past its end: refused up front (it used to fail on the second slab)."""
    from hicache.errors import HiCacheError

    host = HostTier(64 << 20, mlock=False)
    assert host.slab_bytes == 1 << 20 and host.max_page_bytes == 512 << 10
    with pytest.raises(HiCacheError, match="raise --host-capacity to at least"):
        host.page_class(b"x" * 16, 700 << 10)
    cls = host.page_class(b"x" * 16, 512 << 10)  # exactly half: every slab holds two
    ids = cls.alloc(2 * host.num_slabs)
    assert ids is not None and len(set(ids.tolist())) == 2 * host.num_slabs


def test_a_growing_class_gets_its_next_slabs_one_store_ahead():
    """Its engines map (and pre-fault) the slabs of the next store before that store."""
    host = HostTier(16 << 20, mlock=False)  # 16 slabs of 1 MiB
    a, owner = host.page_class(b"a" * 16, PB), b"a" * 16
    per_slab = host.slab_bytes // PB
    first = a.alloc(2 * per_slab)  # a store of two slabs' pages: two more are kept spare
    assert len(host.slabs_of(owner)) == 4 and host.spare_slabs == 2
    assert host.used_bytes == 2 * per_slab * PB  # a spare holds no page: no usage, no quota
    mapped, version = {s for s, _ in host.slabs_of(owner)}, host.slab_version(owner)
    second = a.alloc(2 * per_slab)
    assert set(a.slab_of(second).tolist()) <= mapped  # the slabs an engine already maps
    assert not set(a.slab_of(second).tolist()) & set(a.slab_of(first).tolist())
    assert host.slab_version(owner) > version and host.spare_slabs == 2  # the next two
    a.free(second)  # emptied slabs stay as the spare, beyond it they go back
    assert host.spare_slabs == 2 and len(host.slabs_of(owner)) == 4
    version = host.slab_version(owner)
    assert a.alloc(2 * per_slab) is not None and host.slab_version(owner) == version + 2
    host.close()


def test_a_class_told_its_store_size_keeps_that_room_before_its_first_store():
    """An engine names its store size at register: its first store lands in slabs its
    engines mapped (and pre-faulted) already; the room holds no page and stays capped."""
    host = HostTier(16 << 20, mlock=False)
    a, owner = host.page_class(b"a" * 16, PB), b"a" * 16
    per_slab = host.slab_bytes // PB
    a.expect_stores(0)
    assert host.spare_slabs == 0 and host.slab_version(owner) == 0
    a.expect_stores(2 * per_slab)
    assert host.spare_slabs == 2 and host.used_bytes == 0 and a.used_pages == 0
    mapped, version = {s for s, _ in host.slabs_of(owner)}, host.slab_version(owner)
    first = a.alloc(2 * per_slab)
    assert first is not None and set(a.slab_of(first).tolist()) <= mapped
    assert host.slab_version(owner) == version + 2  # the next store's room, taken after this one
    b = host.page_class(b"b" * 16, PB)
    b.expect_stores(1 << 30)  # more than the arena: a quarter at most
    assert len(b.slabs) == host.num_slabs // 4 and b.used_pages == 0
    host.close()


def test_spare_slabs_are_capped_at_a_quarter_of_the_arena():
    host = HostTier(16 << 20, mlock=False)
    a = host.page_class(b"a" * 16, PB)
    assert a.alloc(8 * (host.slab_bytes // PB)) is not None  # half the arena in one store
    assert host.spare_slabs == host.num_slabs // 4
    host.close()


def test_another_namespace_takes_a_spare_slab_first_punched_out():
    """No free slab: b gets a's spare (no page of a moves or goes), and a's old
    mapping of it reads zeros."""
    host = HostTier(4 << 20, mlock=False)  # 4 slabs: a spare of at most one
    a, b = host.page_class(b"a" * 16, PB), host.page_class(b"b" * 16, PB)
    per_slab = host.slab_bytes // PB
    assert a.alloc(2 * per_slab) is not None and b.alloc(1) is not None
    assert host.free_slabs == 0 and host.spare_slabs == 1
    (spare, gen), = [(s, host.arena.slab_gen(s)) for s in a.slabs if a.used_in(s) == 0]
    engine_a = HostArena.reserve(host.num_slabs, host.slab_bytes)
    engine_a.map_slab(spare, os.dup(host.arena.slab_fd(spare)), gen)
    host.arena.array[spare * host.slab_bytes:(spare + 1) * host.slab_bytes] = 0xAA
    got = b.alloc(per_slab)  # b's own slab is not full: this needs another one
    assert got is not None and spare in set(b.slab_of(got).tolist())
    assert host.owner_of[spare] == b"b" * 16 and host.arena.slab_gen(spare) == gen + 1
    assert a.used_pages == 2 * per_slab and host.spare_slabs == 0
    assert not engine_a.array[spare * host.slab_bytes:(spare + 1) * host.slab_bytes].any()
    engine_a.close()
    host.close()
