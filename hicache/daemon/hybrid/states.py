"""HybridStates: the daemon side of hybrid-model state checkpoints.

A namespace registered with a StateLayout (hicache/state_layout.py) gets a
CheckpointIndex beside its RadixIndex (hicache/index/checkpoints.py has the
rules). This module decides where checkpoints live and speaks for them in the
engine cycle (their disk movement is hicache/daemon/hybrid/disk.py's);
CacheService keeps doing the KV.

Where a checkpoint's bytes live
- device: the engine's StatePool slots, private to each request. The daemon
  never tracks device copies: an engine restores a checkpoint by copying it
  into a fresh slot of its own (copy on write, SGLang's `fork_from`).
- host: a *state slot* of the arena: a host page class whose page is one
  checkpoint (`checkpoint_bytes`), numbered like KV pages (byte offset = slot *
  checkpoint_bytes), so an engine finds it in the arena it already maps.
- disk: one record per checkpoint in the disk tier, under the namespace's
  *state salt*, so no KV read can ever return it (hybrid_disk.py has the rest).

The cycle, for a request of engine E in a hybrid namespace
  match   -> the usable prefix: the deepest resident checkpoint on the KV
             match. The KV part of the pin is cut there (the engine has no use
             for KV beyond its state), and the checkpoint is locked until
             release. A checkpoint only on disk is read into a fresh state slot
             at once; the reply says `pending` and `load` waits for it (per the
             load policy). `fork_at` tells the engine where the request leaves
             the tree inside a node: the checkpoint the store rule will want.
  insert  -> the engine offers checkpoints (position, device state slot); the
             rule keeps those at or before its target; each kept one gets a
             host state slot (evicting LRU checkpoints, never KV), returned as
             a state backup plan.
  state_backup_done -> the copies are in place: the checkpoints become
             host-resident and, with a disk tier, are written through to disk.

Budgets: checkpoints are big and each is one request's worth of state, so they
get their own share of the host arena (`host_fraction`) and of the disk budget
(`disk_fraction`), each under its own LRU; KV eviction never makes room for
them and they never make room for KV.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.core.host_tier import PageClass
from hicache.daemon.hybrid.disk import HybridDiskMover
from hicache.daemon.hybrid.records import NsStates, StateCounters, StatePin
from hicache.daemon.core.service import CacheService, EngineRecord, NamespaceState, Pin
from hicache.errors import LayoutError
from hicache.index.checkpoints import Checkpoint, CheckpointIndex, EvictedState
from hicache.index.keys import KEY_BYTES, Namespace
from hicache.index.node import Tier, TreeNode
from hicache.rpc.protocol import Code, RpcError
from hicache.state_layout import StateLayout

if TYPE_CHECKING:
    from hicache.tiers.disk.tier import DiskTier


def state_salt(salt: bytes) -> bytes:
    """The disk-tier salt of a namespace's checkpoints."""
    return hashlib.blake2b(salt, digest_size=KEY_BYTES, person=b"hicache-states").digest()


@dataclass(slots=True, eq=False)
class StateBackup:
    backup_id: int
    engine: EngineRecord
    hs: NsStates
    entries: list[tuple[TreeNode, int, int, int]]  # (node, position, host slot, device slot)


class HybridStates:
    def __init__(self, service: CacheService, *, host_fraction: float = 0.25, disk_capacity: int = 0,
                 disk_fraction: float = 0.25, load_policy: str = "best_effort",
                 prefetch_timeout_s: float = 0.05) -> None:
        self.svc = service
        self.host_budget = int(service.host.capacity_bytes * host_fraction)
        self.disk_budget = int(disk_capacity * disk_fraction)
        self.load_policy = load_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        self.by_salt: dict[bytes, NsStates] = {}
        self.pins: dict[int, StatePin] = {}
        self.backups: dict[int, StateBackup] = {}
        self.counters = StateCounters()
        self._ids = itertools.count(1)
        self.host_bytes = 0
        self.disk_mover = HybridDiskMover(self)
        service.hybrid = self
        service.on_pin_dropped = self._pin_dropped

    # -- namespaces ---------------------------------------------------------
    def check_namespace(self, namespace: Namespace) -> None:
        """Refuse a state layout the index or the arena cannot hold (before anything changes)."""
        st = namespace.state
        if st is None:
            return
        if st.chunk_size % namespace.layout.page_size:
            raise RpcError(Code.BAD_PARAMS, f"chunk_size {st.chunk_size} is not a multiple of the page size "
                                            f"{namespace.layout.page_size}")
        if st.checkpoint_bytes > self.svc.host.slab_bytes or st.checkpoint_bytes > self.host_budget:
            raise RpcError(Code.BAD_PARAMS, f"a checkpoint of {st.checkpoint_bytes} bytes does not fit the "
                                            f"host share for states ({self.host_budget} bytes)")

    def of(self, ns: NamespaceState) -> NsStates | None:
        """The namespace's checkpoints, or None for a pure-attention namespace."""
        hs = self.by_salt.get(ns.salt)
        if hs is None and ns.namespace.state is not None:
            st = ns.namespace.state
            slots = self.svc.host.page_class(ns.salt, st.checkpoint_bytes, "state")
            hs = NsStates(ns, st, CheckpointIndex(ns.index, st.chunk_size), slots,
                          state_salt(ns.salt))
            self.by_salt[ns.salt] = hs
        return hs

    def forget(self, ns: NamespaceState) -> bool:
        """CacheService drops an empty namespace: drop its checkpoints' side too, unless
        it still holds any (then the namespace stays). True when nothing is left here."""
        hs = self.by_salt.get(ns.salt)
        if hs is None:
            return True
        if hs.slots.used_pages or hs.ckpts.count(Tier.HOST) or hs.ckpts.count(Tier.DISK):
            return False
        del self.by_salt[ns.salt]
        self.svc.host.forget_class(hs.slots)
        return True

    def attach_disk(self, tier: DiskTier | None, loop: asyncio.AbstractEventLoop) -> None:
        self.disk_mover.attach(tier, loop)

    def restore_disk(self, salt: bytes, records: list[tuple], tier: DiskTier) -> bool:
        """DiskMover's rebuild hands over the records of salts it does not know: False when
        `salt` is no namespace's state salt either."""
        return self.disk_mover.restore(salt, records, tier)

    # -- match / load / release ----------------------------------------------
    def match(self, owner: object, engine_id: Any, keys: Any) -> tuple[Pin, dict | None]:
        rec = self.svc.engine(owner, engine_id)
        hs = self.of(rec.ns)
        if hs is None:
            return self.svc.match(owner, engine_id, keys), None
        self.reap(rec.ns)
        ps = rec.ns.index.page_size
        probe = hs.ckpts.probe(keys, rec.engine_id)
        best = probe.checkpoint
        usable_pages = 0 if best is None else best.position // ps
        pin = self.svc.match(owner, engine_id, keys[:usable_pages])
        self.svc.counters.requested_pages += len(keys) - usable_pages  # match counted only the cut
        fallback = None
        if best is not None:
            hs.ckpts.touch(best)
            hs.ckpts.lock(best)
            if best.host_slot is None:
                fallback = self._host_checkpoint_above(best)
                if fallback is not None:
                    hs.ckpts.lock(fallback)
        sp = StatePin(pin, hs, probe.kv_pages * ps, probe.fork_tokens, best, fallback)
        self.pins[pin.pin_id] = sp
        if best is not None and best.host_slot is None:
            self.disk_mover.prefetch(sp)
        c = self.counters
        c.matches += 1
        c.kv_tokens += probe.kv_pages * ps
        return pin, self.state_reply(sp)

    def state_reply(self, sp: StatePin) -> dict:
        """What the engine may restore now: the deepest locked checkpoint with a host copy
        within the KV it holds or loads (`pending`: call `load`, more may come)."""
        pin, ps = sp.pin, sp.hs.ns.index.page_size
        kv_avail = (pin.device_len + pin.host_len) * ps
        use = None
        for ck in (sp.best, sp.fallback):
            if ck is not None and not ck.removed and ck.host_slot is not None and ck.position <= kv_avail:
                use = ck
                break
        waiting = sp.prefetch is not None and not sp.prefetch.done
        return {"kv_len": sp.kv_tokens, "len": 0 if use is None else use.position,
                "slot": None if use is None else use.host_slot, "fork_at": sp.fork_tokens,
                "pending": bool(pin.disk_len) or waiting}

    async def load(self, pin: Pin, policy: str | None = None) -> dict | None:
        """For `load`: wait for the checkpoint's disk read per `policy` (the `load`'s
        `until`; None: the load policy)."""
        sp = self.pins.get(pin.pin_id)
        if sp is None:
            return None
        pf = sp.prefetch
        policy = policy or self.load_policy
        if pf is not None and not pf.done and pf.future is not None:
            if policy == "wait_complete":
                await asyncio.shield(pf.future)
            elif policy == "timeout":
                try:
                    await asyncio.wait_for(asyncio.shield(pf.future), self.prefetch_timeout_s)
                except asyncio.TimeoutError:
                    pass
            if not pf.done:  # its callback runs on the loop turn after the future resolves
                await asyncio.sleep(0)
        if pin.pin_id not in self.pins:
            return None
        return self.state_reply(sp)

    def _pin_dropped(self, pin: Pin) -> None:
        sp = self.pins.pop(pin.pin_id, None)
        if sp is None:
            return
        hs = sp.hs
        reply = self.state_reply(sp)
        self.counters.usable_tokens += reply["len"]
        for ck in (sp.best, sp.fallback):
            if ck is not None:
                hs.ckpts.unlock(ck)
        self.reap(hs.ns)

    def _host_checkpoint_above(self, ck: Checkpoint) -> Checkpoint | None:
        node = ck.node.parent
        while node is not None and node.parent is not None:
            st = node.state
            if isinstance(st, Checkpoint) and st.host_slot is not None:
                return st
            node = node.parent
        return None

    # -- insert / backup -------------------------------------------------------
    def insert(self, owner: object, engine_id: Any, keys: Any, tokens: np.ndarray, device_pages: np.ndarray,
               pin_id: Any, offers: Any) -> tuple[int, np.ndarray, Any, StateBackup | None]:
        rec = self.svc.engine(owner, engine_id)
        hs = self.of(rec.ns)
        if hs is None:
            if offers:
                raise RpcError(Code.BAD_PARAMS, "this namespace has no state layout: no checkpoints to offer")
            return (*self.svc.insert(owner, engine_id, keys, tokens, device_pages, pin_id), None)
        offered = self._check_offers(offers, len(keys) * rec.ns.index.page_size)
        sp = self.pins.get(pin_id) if isinstance(pin_id, int) else None
        # The fork the request was told about at match; without a match, the one its insert makes.
        fork = sp.fork_tokens if sp is not None else hs.ckpts.probe(keys, rec.engine_id).fork_tokens
        present, dups, backup = self.svc.insert(owner, engine_id, keys, tokens, device_pages, pin_id)
        self.reap(rec.ns)
        entries: list[tuple[TreeNode, int, int]] = []
        for pos in hs.ckpts.positions_to_store(offered, len(keys) * rec.ns.index.page_size, fork):
            node = hs.ckpts.node_for(keys, pos)
            if node is None:
                continue
            ck = node.state
            if isinstance(ck, Checkpoint) and ck.host_slot is not None:
                hs.ckpts.touch(ck)  # another request stored it already
                continue
            entries.append((node, pos, offered[pos]))
        state_backup = None
        if entries:
            slots = self.alloc_host(hs, len(entries))
            if slots is None:
                self.counters.skipped_no_space += 1
            else:
                state_backup = StateBackup(next(self._ids), rec, hs,
                                           [(n, p, int(s), d) for (n, p, d), s in zip(entries, slots)])
                self.backups[state_backup.backup_id] = state_backup
        return present, dups, backup, state_backup

    @staticmethod
    def _check_offers(offers: Any, seq_tokens: int) -> dict[int, int]:
        if offers is None:
            return {}
        if not isinstance(offers, list):
            raise RpcError(Code.BAD_PARAMS, "states must be a list of [position, device state slot]")
        out: dict[int, int] = {}
        for item in offers:
            if (not isinstance(item, (list, tuple)) or len(item) != 2
                    or any(type(x) is not int for x in item)):
                raise RpcError(Code.BAD_PARAMS, "each state offer is [position, device state slot] (ints)")
            pos, slot = item
            if not 0 < pos <= seq_tokens or slot < 1 or pos in out:
                raise RpcError(Code.BAD_PARAMS, f"bad state offer {item}: positions are distinct, in "
                                                f"1..{seq_tokens}; slots >= 1")
            out[pos] = slot
        if len(set(out.values())) != len(out):
            raise RpcError(Code.BAD_PARAMS, "state offers repeat a device slot")
        return out

    def backup_done(self, owner: object, backup_id: Any, ok: bool) -> int:
        """The engine copied (or failed to copy) the checkpoints; returns how many were stored."""
        b = self.backups.get(backup_id) if isinstance(backup_id, int) else None
        if b is None or b.engine.owner is not owner:
            raise RpcError(Code.NOT_FOUND, f"no state backup {backup_id!r} on this connection")
        return self._finish(b, ok)

    def _finish(self, b: StateBackup, ok: bool) -> int:
        del self.backups[b.backup_id]
        hs = b.hs
        self.reap(hs.ns)
        stored: list[Checkpoint] = []
        spare: list[int] = []
        for node, _pos, slot, _dev in b.entries:
            if not ok or node.removed:
                spare.append(slot)
                continue
            ck, extra = hs.ckpts.put(node, host_slot=slot)
            if extra is None:
                stored.append(ck)
            else:
                spare.append(extra)
        self.free_host(hs, spare)
        self.counters.stored += len(stored)
        if stored:
            self.svc.emit({"type": "stored", "tier": "host", "engine": None, "namespace": hs.ns.salt.hex(),
                           "states": [[c.position, c.node.keys[-1]] for c in stored]})
            self.disk_mover.write_through(hs, stored)
        return len(stored)

    def disconnect(self, owner: object) -> None:
        for b in [b for b in self.backups.values() if b.engine.owner is owner]:
            self._finish(b, ok=False)

    # -- host slots --------------------------------------------------------------
    def alloc_host(self, hs: NsStates, n: int) -> np.ndarray | None:
        """n host state slots within the states' share, evicting LRU checkpoints (any
        hybrid namespace) as needed; None when locked ones fill it."""
        nbytes = hs.layout.checkpoint_bytes
        while self.host_bytes + n * nbytes > self.host_budget:
            if not self._evict_one_host(None):
                return None
        slots = hs.slots.alloc(n)
        while slots is None:  # the arena itself is full: only our own slots can make room
            if not self._evict_one_host(hs.slots):
                return None
            slots = hs.slots.alloc(n)
        self.host_bytes += n * nbytes
        return slots

    def free_host(self, hs: NsStates, slots: Iterable[int]) -> None:
        slots = list(slots)
        if slots:
            hs.slots.free(np.asarray(slots, dtype=np.int64))
            self.host_bytes -= len(slots) * hs.layout.checkpoint_bytes

    def _evict_one_host(self, cls: PageClass | None) -> bool:
        """Drop the least recently used unlocked host checkpoint (of page class `cls`, or
        any), demoting it to disk first when it has no disk copy."""
        victim = self._oldest(Tier.HOST, cls)
        if victim is None:
            return False
        first = victim.ckpts.next_victim(Tier.HOST)
        if not first.on_disk:
            self.disk_mover.demote(victim, first)
        (ev,) = victim.ckpts.evict(Tier.HOST, 1)
        self.drop_evicted(victim, [ev])
        return True

    def evict_one_disk(self) -> bool:
        """Drop the disk copy of the least recently used unlocked checkpoint (any hybrid
        namespace); False when none can go."""
        victim = self._oldest(Tier.DISK, None)
        if victim is None:
            return False
        self.drop_evicted(victim, victim.ckpts.evict(Tier.DISK, 1))
        return True

    def _oldest(self, tier: Tier, cls: PageClass | None) -> NsStates | None:
        best, best_at = None, None
        for hs in self.by_salt.values():
            if cls is not None and hs.slots is not cls:
                continue
            at = hs.ckpts.peek_evictable(tier)
            if at is not None and (best_at is None or at < best_at):
                best, best_at = hs, at
        return best

    def drop_evicted(self, hs: NsStates, evicted: list[EvictedState]) -> None:
        for ev in evicted:
            self.counters.evicted["host" if ev.tier is Tier.HOST else "disk"] += 1
            self.counters.tombstones += ev.tombstone
            if ev.tier is Tier.HOST and ev.host_slot is not None:
                self.free_host(hs, [ev.host_slot])
            elif ev.tier is Tier.DISK:
                self.disk_mover.delete(hs, [ev.checkpoint], force=True)  # its on_disk flag is down already
        if evicted:
            self.svc.emit({"type": "removed", "tier": "host" if evicted[0].tier is Tier.HOST else "disk",
                           "engine": None, "namespace": hs.ns.salt.hex(),
                           "states": [[e.checkpoint.position, e.checkpoint.node.keys[-1]] for e in evicted
                                      if not e.checkpoint.node.removed]})

    def reap(self, ns: NamespaceState) -> None:
        """Free what checkpoints of removed KV nodes held."""
        hs = self.by_salt.get(ns.salt)
        if hs is None:
            return
        removed = hs.ckpts.take_removed()
        if not removed:
            return
        self.free_host(hs, [c.host_slot for c in removed if c.host_slot is not None])
        self.disk_mover.delete(hs, removed)  # those on disk or being written
        for c in removed:
            c.host_slot = None
            c.on_disk = False

    def host_view(self, hs: NsStates, slot: int) -> memoryview:
        nbytes = hs.layout.checkpoint_bytes
        return memoryview(self.svc.host.arena.array[slot * nbytes:(slot + 1) * nbytes])

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {"namespaces": len(self.by_salt), "host_budget_bytes": self.host_budget,
                "host_bytes": self.host_bytes, "disk_budget_bytes": self.disk_budget,
                "disk_bytes": self.disk_mover.disk_bytes,
                "host_checkpoints": sum(h.ckpts.count(Tier.HOST) for h in self.by_salt.values()),
                "disk_checkpoints": sum(h.ckpts.count(Tier.DISK) for h in self.by_salt.values()),
                "matches": c.matches, "usable_tokens": c.usable_tokens, "kv_tokens": c.kv_tokens,
                "stored": c.stored, "skipped_no_space": c.skipped_no_space, "evicted": dict(c.evicted),
                "tombstones": c.tombstones, "disk_writes": c.disk_writes, "disk_reads": c.disk_reads,
                "disk_misses": c.disk_misses, "restored": c.restored, "disk_orphans": c.disk_orphans, "pending_backups": len(self.backups)}


def state_layout_param(value: Any) -> StateLayout | None:
    """Decode the optional `state` parameter of `register`."""
    if value is None:
        return None
    try:
        return StateLayout.from_dict(value)
    except (LayoutError, TypeError) as e:
        raise RpcError(Code.BAD_PARAMS, f"bad state layout: {e}") from None
