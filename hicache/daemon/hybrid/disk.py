"""HybridDiskMover: moves state checkpoints between the host state slots and the disk tier.

HybridStates (hicache/daemon/hybrid/states.py) decides what is stored and evicted, as
DiskMover (hicache/daemon/movers/disk_mover.py) does for KV pages; this module only
moves a checkpoint's bytes and keeps its disk bookkeeping.

- Records: one per checkpoint in the disk tier, under the namespace's *state
  salt* (so no KV read can ever return it), keyed by
  `checkpoint_disk_key(end page key)`, its parent field naming that end page
  (what the rebuild after a restart hangs it on).
- Write-through: once a checkpoint becomes host-resident it is queued for disk.
  Demotion: before a host eviction, a checkpoint with no disk copy is queued.
  Either way the bytes are copied out at once: a host slot may be reused
  before the writer gets to it.
- Budget: the states' own share of the disk (`disk_budget`), under their own
  disk LRU: before queueing, the disk copies of the least recently used
  unlocked checkpoints (any hybrid namespace) are dropped until it fits.
- Prefetch: a match whose best checkpoint is only on disk reads it into a fresh
  host state slot at once; `load` waits for it per the load policy.
- Rebuild: at startup, after the KV rebuild, records of a state salt are hung
  on the restored tree; those that no longer fit it are deleted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from hicache.daemon.hybrid.records import NsStates, StateHost, StatePin, StatePrefetch
from hicache.index.checkpoints import Checkpoint, checkpoint_disk_key
from hicache.index.node import Tier, TreeNode

if TYPE_CHECKING:
    from hicache.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)

NO_TOKENS = np.empty(0, dtype=np.int32)


class HybridDiskMover:
    def __init__(self, states: StateHost) -> None:
        self.states = states
        self.tier: DiskTier | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.disk_bytes = 0
        self._writing: set[Checkpoint] = set()  # disk writes in flight

    def attach(self, tier: DiskTier | None, loop: asyncio.AbstractEventLoop) -> None:
        self.tier = tier
        self.loop = loop

    # -- host -> disk ------------------------------------------------------------------
    def write_through(self, hs: NsStates, ckpts: list[Checkpoint]) -> None:
        for ck in ckpts:
            if not ck.on_disk and ck.host_slot is not None:
                self._write(hs, ck, demote=False)

    def demote(self, hs: NsStates, ck: Checkpoint) -> None:
        self._write(hs, ck, demote=True)

    def _write(self, hs: NsStates, ck: Checkpoint, demote: bool) -> None:
        """Queue the checkpoint's host copy for disk. A demotion is flagged on disk at
        once, so the checkpoint survives losing its host copy; a write-through when the
        commit reports back."""
        states = self.states
        if self.tier is None or states.disk_budget <= 0:
            return
        if ck in self._writing:  # already queued: its bytes are on their way
            if demote:
                hs.ckpts.put(ck.node, on_disk=True)
            return
        nbytes = hs.layout.checkpoint_bytes
        while self.disk_bytes + nbytes > states.disk_budget:
            if not states.evict_one_disk():
                return
        data = bytes(states.host_view(hs, ck.host_slot))
        loop = self.loop

        def done(key: bytes, ok: bool) -> None:  # on the writer thread
            loop.call_soon_threadsafe(self._written, hs, ck, ok, demote)

        # its parent field anchors it to a KV page of another salt, which may reach disk later
        if not self.tier.put_async(hs.disk_salt, ck.disk_key, ck.node.keys[-1], NO_TOKENS, data, done,
                                   parent_required=False):
            return
        self._writing.add(ck)
        self.disk_bytes += nbytes
        states.counters.disk_writes += 1
        if demote:
            hs.ckpts.put(ck.node, on_disk=True)

    def _written(self, hs: NsStates, ck: Checkpoint, ok: bool, demote: bool) -> None:
        if ck not in self._writing:
            return  # cancelled: its disk copy was dropped meanwhile, a delete queued behind it
        self._writing.discard(ck)
        if not ok:
            self.disk_bytes -= hs.layout.checkpoint_bytes
            if demote and not ck.removed and ck.on_disk:  # flagged too early: forget it
                ev = hs.ckpts.drop(ck, Tier.DISK)
                if ev is not None:
                    self.states.counters.tombstones += ev.tombstone
        elif not ck.removed and not ck.on_disk:
            hs.ckpts.put(ck.node, on_disk=True)

    def delete(self, hs: NsStates, ckpts: list[Checkpoint], force: bool = False) -> None:
        """Delete the disk records of these checkpoints (those on disk, being written, or
        all with `force`); a write still in flight is cancelled (the delete follows it)."""
        keys = []
        for c in ckpts:
            writing = c in self._writing
            self._writing.discard(c)
            if c.on_disk or force or writing:
                keys.append(c.disk_key)
        if keys and self.tier is not None:
            self.tier.delete_async(keys)
            self.disk_bytes -= len(keys) * hs.layout.checkpoint_bytes

    # -- disk -> host --------------------------------------------------------------------
    def prefetch(self, sp: StatePin) -> None:
        """Read a disk-only checkpoint into a fresh host state slot."""
        if self.tier is None or sp.best is None:
            return
        states = self.states
        hs, ck = sp.hs, sp.best
        slots = states.alloc_host(hs, 1)
        if slots is None:
            return
        pf = StatePrefetch(ck, int(slots[0]))
        sp.prefetch = pf
        fut = self.tier.get_many_async(hs.disk_salt, [ck.disk_key], [states.host_view(hs, pf.host_slot)])
        pf.future = asyncio.wrap_future(fut, loop=self.loop)
        pf.future.add_done_callback(lambda f: self._prefetched(sp, pf, f))
        states.counters.disk_reads += 1

    def _prefetched(self, sp: StatePin, pf: StatePrefetch, fut: asyncio.Future) -> None:
        pf.done = True
        states = self.states
        hs, ck = sp.hs, pf.ckpt
        try:
            hit = bool(fut.result()[0])
        except Exception:
            log.exception("checkpoint read failed")
            hit = False
        if hit and not ck.removed:
            _, spare = hs.ckpts.put(ck.node, host_slot=pf.host_slot)
            if spare is not None:
                states.free_host(hs, [spare])
            return
        states.free_host(hs, [pf.host_slot])
        if not hit and not ck.removed:
            states.counters.disk_misses += 1
            if sp.best is ck and sp.pin.pin_id in states.pins:
                sp.best = None  # the request falls back to a shallower checkpoint
                hs.ckpts.unlock(ck)
            # the record is gone or corrupt (the tier deleted it): forget the disk copy
            states.drop_evicted(hs, [e for e in [hs.ckpts.drop(ck, Tier.DISK)] if e is not None])

    # -- rebuild -------------------------------------------------------------------------
    def restore(self, salt: bytes, records: list[tuple], tier: DiskTier) -> bool:
        """At startup, after the KV rebuild: hang the checkpoint records of `salt`, if it
        is some namespace's state salt, on the restored tree. Records are (key, end page
        key, tokens, last_access); those whose end page is not in the tree, or not at a
        chunk boundary, are deleted. False: not a state salt (nothing done)."""
        states = self.states
        hs = next((h for h in (states.of(ns) for ns in states.svc.namespaces.values())
                   if h is not None and h.disk_salt == salt), None)
        if hs is None:
            return False
        index = hs.ns.index
        where: dict[bytes, tuple[TreeNode, int]] = {}  # page key -> (node, pages of the path up to it)
        stack = [(c, 0) for c in index.root.children.values()]
        while stack:
            node, before = stack.pop()
            for j, key in enumerate(node.keys):
                where[key] = (node, before + j + 1)
            stack.extend((c, before + node.n_pages) for c in node.children.values())
        orphans: list[bytes] = []
        restored = 0
        for key, end_key, _tokens, last_access in sorted(records, key=lambda r: r[3]):  # LRU order
            hit = where.get(end_key)
            if hit is None or key != checkpoint_disk_key(end_key) or \
                    (hit[1] * index.page_size) % hs.layout.chunk_size:
                orphans.append(key)
                continue
            node, pages = hit
            # a split keeps the lower half, so `node`'s path still covers the first `pages` keys
            end = index.node_ending_at(_path_keys(node)[:pages])
            ck, _ = hs.ckpts.put(end, on_disk=True)
            ck.last_access = float(last_access)
            restored += 1
        self.disk_bytes += restored * hs.layout.checkpoint_bytes  # the reads check the size
        states.counters.restored += restored
        states.counters.disk_orphans += len(orphans)
        if orphans:
            tier.delete_async(orphans)
        log.info("restored %d state checkpoints of namespace %s (%d orphans dropped)", restored,
                 hs.ns.salt.hex()[:16], len(orphans))
        return True


def _path_keys(node: TreeNode) -> list[bytes]:
    chain = []
    while node is not None and node.parent is not None:
        chain.append(node)
        node = node.parent
    return [k for n in reversed(chain) for k in n.keys]
