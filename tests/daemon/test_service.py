"""CacheService scenarios in-process: write policies, host pressure, pins."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.index.keys import Namespace, page_keys
from hicache.index.node import Tier
from hicache.layout import KVLayout
from hicache.rpc.protocol import RpcError
from hicache.transfer.policy import WritePolicy

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)  # 256 B pages


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def make(policy=WritePolicy.WRITE_THROUGH, host_bytes=1 << 20, threshold=2):
    svc = CacheService(HostTier(host_bytes, mlock=False), write_policy=policy, write_hit_threshold=threshold,
                       clock=Clock())
    owner = object()
    rec = svc.register(owner, Namespace("m", LAYOUT), device_pages=512)
    return svc, owner, rec


def seq(seed: int, pages: int, salt: bytes) -> tuple[list[bytes], np.ndarray]:
    toks = np.random.default_rng(seed).integers(0, 1000, pages * 4, dtype=np.int32)
    return page_keys(salt, toks, 4), toks


def test_write_through_backs_up_on_insert_and_host_serves_after_device_eviction():
    svc, owner, rec = make()
    keys, toks = seq(1, 6, rec.ns.salt)
    present, dups, backup = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 7))
    assert present == 0 and len(dups) == 0 and backup is not None
    assert list(backup.device_pages) == [1, 2, 3, 4, 5, 6] and len(backup.host_pages) == 6
    # the device copies are locked until the backup is done: eviction cannot take them
    free_now, _ = svc.evict_device(owner, rec.engine_id, 6)
    assert len(free_now) == 0
    svc.backup_done(owner, backup.backup_id, ok=True)
    free_now, _ = svc.evict_device(owner, rec.engine_id, 6)
    assert sorted(free_now) == [1, 2, 3, 4, 5, 6]
    pin = svc.match(owner, rec.engine_id, keys)
    assert pin.device_len == 0 and pin.host_len == 6
    assert list(pin.host_pages) == list(backup.host_pages)


def test_failed_backup_frees_its_host_pages_and_records_nothing():
    svc, owner, rec = make()
    keys, toks = seq(2, 4, rec.ns.salt)
    used0 = svc.host.used_bytes
    _, _, backup = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 5))
    assert svc.host.used_bytes > used0
    svc.backup_done(owner, backup.backup_id, ok=False)
    assert svc.host.used_bytes == used0
    assert rec.ns.index.num_pages(Tier.HOST) == 0
    with pytest.raises(RpcError):
        svc.backup_done(owner, backup.backup_id, ok=True)  # twice: refused


def test_write_through_selective_waits_for_hits():
    svc, owner, rec = make(WritePolicy.WRITE_THROUGH_SELECTIVE, threshold=2)
    keys, toks = seq(3, 4, rec.ns.salt)
    assert svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 5))[2] is None  # cold: no backup
    for _ in range(2):
        svc.release(owner, svc.match(owner, rec.engine_id, keys).pin_id)
    _, _, backup = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 5))
    assert backup is not None and len(backup.host_pages) == 4  # hot now: backed up


def test_write_back_copies_out_on_eviction_then_frees():
    svc, owner, rec = make(WritePolicy.WRITE_BACK)
    keys, toks = seq(4, 5, rec.ns.salt)
    assert svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 6))[2] is None
    free_now, backup = svc.evict_device(owner, rec.engine_id, 5)
    assert len(free_now) == 0 and backup is not None  # not on host yet: back up first
    assert sorted(backup.device_pages) == [1, 2, 3, 4, 5]
    freed = svc.backup_done(owner, backup.backup_id, ok=True)
    assert sorted(freed) == [1, 2, 3, 4, 5]  # now the engine frees them
    pin = svc.match(owner, rec.engine_id, keys)
    assert pin.device_len == 0 and pin.host_len == 5


def test_host_pressure_takes_a_slab_from_the_namespace_with_the_oldest_pages():
    svc = CacheService(HostTier(8 << 20, mlock=False), clock=Clock())
    per_slab = svc.host.slab_bytes // LAYOUT.page_bytes
    total = per_slab * svc.host.num_slabs
    assert svc.host.num_slabs == 8
    a_owner, b_owner = object(), object()
    a = svc.register(a_owner, Namespace("a", LAYOUT), device_pages=total * 2)
    b = svc.register(b_owner, Namespace("b", LAYOUT), device_pages=total * 2)
    ka, ta = seq(5, total // 2, a.ns.salt)
    kb, tb = seq(6, total // 2, b.ns.salt)
    for owner, rec, k, t in ((a_owner, a, ka, ta), (b_owner, b, kb, tb)):
        _, _, bk = svc.insert(owner, rec.engine_id, k, t, np.arange(1, len(k) + 1))
        svc.backup_done(owner, bk.backup_id, ok=True)
    assert svc.host.used_bytes == total * LAYOUT.page_bytes  # full
    kc, tc = seq(7, 8, b.ns.salt)
    _, _, bk = svc.insert(b_owner, b.engine_id, kc, tc, np.arange(len(kb) + 1, len(kb) + 9))
    assert bk is not None and len(bk.host_pages) == 8  # room was made
    # a's pages were inserted first, so a's namespace gave up pages (its one node), and b one slab
    assert a.ns.index.num_pages(Tier.HOST) < len(ka)
    assert b.ns.index.num_pages(Tier.HOST) == len(kb)
    owners = svc.host.owner_of
    assert owners.count(b.ns.salt) == 5 and owners.count(a.ns.salt) + svc.host.free_slabs == 3


def test_pins_protect_host_pages_from_eviction():
    svc, owner, rec = make()
    keys, toks = seq(8, 4, rec.ns.salt)
    _, _, bk = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 5))
    svc.backup_done(owner, bk.backup_id, ok=True)
    svc.evict_device(owner, rec.engine_id, 4)
    pin = svc.match(owner, rec.engine_id, keys)
    assert pin.host_len == 4
    assert svc.flush(Tier.HOST) == 0  # pinned: kept
    svc.release(owner, pin.pin_id)
    assert svc.flush(Tier.HOST) == 4


def test_admin_eviction_and_flush_go_in_steps_the_loop_can_run_between():
    svc = CacheService(HostTier(16 << 20, mlock=False), clock=Clock())  # a slab for each namespace
    for n, model in enumerate(("a", "b", "c")):
        owner = object()
        rec = svc.register(owner, Namespace(model, LAYOUT), device_pages=512)
        for i in range(10):  # ten 4-page branches each: whole nodes of 4 pages
            keys, toks = seq(100 * n + i, 4, rec.ns.salt)
            _, _, bk = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1 + 4 * i, 5 + 4 * i))
            svc.backup_done(owner, bk.backup_id, ok=True)
    assert [ns.index.num_pages(Tier.HOST) for ns in svc.namespaces.values()] == [40, 40, 40]
    steps = list(svc.evict_tier_steps(Tier.HOST, 40 * LAYOUT.page_bytes, step_pages=8))
    assert len(steps) == 5 and steps[-1] == 40 * LAYOUT.page_bytes  # 8 pages (2 nodes) a step
    assert steps == sorted(steps)
    flushed = list(svc.flush_steps(Tier.HOST))
    assert len(flushed) == 3 and flushed[-1] == 120 - 40  # one step per namespace, counting up
    assert sum(ns.index.num_pages(Tier.HOST) for ns in svc.namespaces.values()) == 0


def test_a_namespace_without_engines_or_pages_is_forgotten_with_its_page_class():
    svc = CacheService(HostTier(8 << 20, mlock=False), clock=Clock())
    for i in range(100):  # a client cycling through ever new namespaces
        owner = object()
        svc.register(owner, Namespace("m", LAYOUT, extra_key=f"tenant-{i}"), device_pages=64)
        svc.disconnect(owner)
    assert svc.namespaces == {} and svc.host.classes == {}
    owner = object()
    rec = svc.register(owner, Namespace("m", LAYOUT, extra_key="keeps"), device_pages=64)
    keys, toks = seq(3, 4, rec.ns.salt)
    _, _, bk = svc.insert(owner, rec.engine_id, keys, toks, np.arange(1, 5))
    svc.backup_done(owner, bk.backup_id, ok=True)
    svc.disconnect(owner)
    assert list(svc.namespaces) == [rec.ns.salt]  # its pages are on host: it stays
    again = object()
    rec2 = svc.register(again, Namespace("m", LAYOUT, extra_key="keeps"), device_pages=64)
    pin = svc.match(again, rec2.engine_id, keys)
    assert pin.host_len == 4
    svc.release(again, pin.pin_id)
    svc.flush(Tier.HOST)
    svc.disconnect(again)
    assert svc.namespaces == {} and svc.host.free_slabs == svc.host.num_slabs
