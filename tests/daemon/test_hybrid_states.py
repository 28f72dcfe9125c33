"""HybridStates in-process, over a real CacheService and host arena: budgets, LRU, locks, slot hygiene."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.hybrid.states import HybridStates
from hicache.daemon.core.service import CacheService
from hicache.index.keys import Namespace, PackedKeys, page_keys
from hicache.index.node import Tier
from hicache.layout import KVLayout
from hicache.rpc.protocol import RpcError
from hicache.state_layout import StateLayout

PS = 16
LAYOUT = KVLayout("mha", num_layers=1, page_size=PS, dtype="float16", num_kv_heads=1, head_dim=8)
STATE = StateLayout(num_layers=1, conv_shapes=((4, 3),), temporal_shape=(2, 4, 4), chunk_size=64)
CB = STATE.checkpoint_bytes


class Setup:
    def __init__(self, budget_checkpoints: int = 100) -> None:
        self.host = HostTier(64 << 20, mlock=False)
        self.svc = CacheService(self.host)
        self.hyb = HybridStates(self.svc, host_fraction=(budget_checkpoints * CB + 1) / self.host.capacity_bytes)
        self.owner = object()
        self.ns = Namespace("hybrid", LAYOUT, state=STATE)
        self.rec = self.svc.register(self.owner, self.ns, device_pages=4096)
        self.hs = self.hyb.of(self.rec.ns)
        self.pages = itertools.count(1)

    def keys(self, tokens: np.ndarray) -> PackedKeys:
        return PackedKeys(b"".join(page_keys(self.rec.ns.salt, tokens, PS)))

    def match(self, tokens: np.ndarray):
        return self.hyb.match(self.owner, self.rec.engine_id, self.keys(tokens))

    def store(self, tokens: np.ndarray, offers: list[int], ok: bool = True, release: bool = True):
        """One request: match, insert with checkpoints offered at `offers`, fill the host
        slots the plan names (byte = position % 251), report."""
        keys = self.keys(tokens)
        pin, state = self.hyb.match(self.owner, self.rec.engine_id, keys)
        n = len(keys)
        dev = np.asarray([next(self.pages) for _ in range(n)], dtype=np.int64)
        _, _, backup, sb = self.hyb.insert(self.owner, self.rec.engine_id, keys, tokens[:n * PS], dev, pin.pin_id,
                                           [[p, i + 1] for i, p in enumerate(offers)])
        if backup is not None:
            self.svc.backup_done(self.owner, backup.backup_id, True)
        stored = None
        if sb is not None:
            for _node, pos, slot, _dev in sb.entries:
                self.hyb.host_view(self.hs, slot)[:] = bytes([pos % 251]) * CB
            stored = self.hyb.backup_done(self.owner, sb.backup_id, ok)
        if release:
            self.svc.release(self.owner, pin.pin_id)
        return state, stored, pin


def seq(seed: int, n: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.int32)


def test_store_then_match_names_the_host_slot_holding_the_bytes():
    s = Setup()
    toks = seq(1, 250)  # 15 full pages (240 tokens): the rule stores at 192
    state, stored, _ = s.store(toks, [64, 128, 192])
    assert state["len"] == 0 and stored == 3
    pin, state = s.match(toks)
    assert state["len"] == 192 and state["kv_len"] == 240 and not state["pending"]
    assert bytes(s.hyb.host_view(s.hs, state["slot"])) == bytes([192 % 251]) * CB
    assert pin.device_len == 12  # the KV part of the pin is cut at the checkpoint
    s.svc.release(s.owner, pin.pin_id)
    assert s.hyb.stats()["host_checkpoints"] == 3 and s.hyb.host_bytes == 3 * CB


def test_the_state_share_evicts_its_own_lru_into_tombstones_and_never_a_locked_one():
    s = Setup(budget_checkpoints=2)
    a, b, c = seq(1), seq(2), seq(3)
    s.store(a, [128])
    s.store(b, [128])
    pin_a, st = s.match(a)  # touches and locks a's checkpoint
    assert st["len"] == 128
    _, stored, _ = s.store(c, [128])  # over budget: b's goes (a's is locked and recent)
    assert stored == 1
    assert s.match(b)[1]["len"] == 0  # a tombstone: KV still there, state gone
    assert s.rec.ns.index.num_pages(Tier.HOST) == 24
    assert s.hyb.counters.tombstones == 1 and s.hyb.host_bytes == 2 * CB
    _, stored, _ = s.store(seq(4), [128])  # only c's is evictable now
    assert stored == 1 and s.match(c)[1]["len"] == 0 and s.match(a)[1]["len"] == 128
    s.svc.release(s.owner, pin_a.pin_id)


def test_no_space_when_every_checkpoint_is_locked():
    s = Setup(budget_checkpoints=1)
    a = seq(1)
    s.store(a, [128])
    pin, _ = s.match(a)
    _, stored, _ = s.store(seq(2), [128])
    assert stored is None and s.hyb.counters.skipped_no_space == 1
    s.svc.release(s.owner, pin.pin_id)


def test_removing_the_kv_frees_the_state_slot():
    s = Setup()
    s.store(seq(1), [128])
    cls = s.hs.slots
    assert cls.used_pages == 1 and s.hyb.host_bytes == CB
    assert s.svc.evict_tier(Tier.HOST, 1 << 30) > 0
    assert cls.used_pages == 1  # the KV is still on the engine's device: the checkpoint stays
    s.svc.disconnect_engine(s.rec)  # now the nodes are in no tier and leave the tree
    assert cls.used_pages == 0 and s.hyb.host_bytes == 0
    assert s.hyb.stats()["host_checkpoints"] == 0


def test_failed_and_abandoned_state_backups_give_their_slots_back():
    s = Setup()
    _, stored, _ = s.store(seq(1), [128], ok=False)
    assert stored == 0 and s.hs.slots.used_pages == 0
    keys = s.keys(seq(2))
    pin, _ = s.hyb.match(s.owner, s.rec.engine_id, keys)
    _, _, _, sb = s.hyb.insert(s.owner, s.rec.engine_id, keys, seq(2), np.arange(1, 9, dtype=np.int64), pin.pin_id,
                               [[128, 1]])
    assert sb is not None and s.hs.slots.used_pages == 1
    s.svc.disconnect(s.owner)  # the engine vanished before reporting
    assert s.hs.slots.used_pages == 0 and not s.hyb.backups and not s.hyb.pins


def test_the_store_rule_through_the_service_keeps_offers_up_to_the_fork():
    s = Setup()
    base = seq(1, 256)
    s.store(base, [256])
    fork = np.r_[base[:128], seq(9, 128)].astype(np.int32)  # leaves base's node at 128
    state, stored, _ = s.store(fork, [64, 128, 256])
    assert state["fork_at"] == 128 and state["len"] == 0
    assert stored == 2  # 64 and 128; the fork's branch end (256) is not kept
    assert sorted(c.position for c in s.hs.ckpts.checkpoints(Tier.HOST)) == [64, 128, 256]
    assert s.match(fork)[1]["len"] == 128 and s.match(base)[1]["len"] == 256


def test_bad_offers_change_nothing():
    s = Setup()
    keys = s.keys(seq(1))
    for bad in ([[64, 1], [64, 2]], [[64, 1], [128, 1]], [[0, 1]], [[999, 1]], [[64, 0]], "x"):
        with pytest.raises(RpcError):
            s.hyb.insert(s.owner, s.rec.engine_id, keys, seq(1), np.arange(1, 9, dtype=np.int64), None, bad)
    assert s.rec.ns.index.num_pages(Tier.DEVICE) == 0 and not s.hyb.backups


def test_a_checkpoint_demoted_to_disk_is_read_back_at_match(tmp_path):
    import asyncio

    from hicache.tiers.disk.tier import DiskTier

    async def scenario() -> None:
        s = Setup(budget_checkpoints=1)
        tier = DiskTier.open(tmp_path / "disk", 64 << 20)
        s.hyb.disk_budget = 100 * CB
        s.hyb.load_policy = "wait_complete"
        s.hyb.attach_disk(tier, asyncio.get_running_loop())
        try:
            a, b = seq(1), seq(2)
            s.store(a, [128])
            s.store(b, [128])  # a's checkpoint leaves host: demoted (flagged on disk at once)
            deadline = time.monotonic() + 30  # a hang guard, not a timing check
            while s.hyb.disk_mover._writing and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            st = s.hyb.stats()
            assert (st["host_checkpoints"], st["disk_checkpoints"], st["tombstones"]) == (1, 2, 0)
            pin, state = s.match(a)
            assert state["pending"] and state["len"] == 0  # not on host yet: ask `load`
            state = await s.hyb.load(pin)
            assert state["len"] == 128 and not state["pending"]
            assert bytes(s.hyb.host_view(s.hs, state["slot"])) == bytes([128 % 251]) * CB
            s.svc.release(s.owner, pin.pin_id)
            assert s.hyb.counters.disk_reads == 1 and s.hyb.host_bytes == CB  # b's went to make room
        finally:
            tier.close()

    asyncio.run(scenario())
