"""DiskMover: moves pages between the host arena and the LMDB disk tier, on the loop's plans.

Every decision (what to write, what to evict, what to prefetch) is taken on the
event-loop thread, where the index lives; the DiskTier's writer thread and
reader pool only move bytes and report back through `post` (batched
`call_soon_threadsafe`).

- Writes (hicache/daemon/movers/disk_writes.py): pages are written through as they
  become host-resident, straight from their arena slots; a full queue delays a
  write (it waits in the backlog, its host copy locked), it never drops it.
  Victims not on disk yet are copied out before host eviction (demotion).
- Budget: the index's disk LRU is the tier's: before queueing, disk leaves are
  evicted until the tier's bytes plus the bytes in flight fit the budget.
- Prefetch: a match whose prefix continues on disk starts reading that part
  into fresh host pages at once; `load` waits for it per the load policy. Its
  timings measure the tier for the fetch-or-recompute rule, which skips a disk
  part the engine computes faster (hicache/daemon/core/fetch_or_recompute.py).
- Placement (`disk_placement`): "inclusive" writes pages through as they reach
  the host (so they survive a restart) and demotes the rest; "non-inclusive"
  only demotes, so the disk holds pages the host does not and the two tiers
  hold more distinct pages; "exclusive" also drops the disk copy of pages read
  back to host, once the reading request releases them, deepest first and only
  while nothing below a page is on disk (parents first stays true on disk).
- Admission (hicache/index/admission.py, `service.admission`): a page is
  written through or demoted only when the policy expects it back; a page
  turned away at write-through may still go down when the host evicts it.
- Rebuild: at startup the disk part of every namespace's tree is restored from
  page metadata; the namespaces themselves (model, layout, ...) come from a
  small sidecar file written (and fsynced) before a namespace's first page is
  queued (disk_namespaces.py). Pages the rebuild cannot hang on the tree are deleted and counted
  (``orphans_dropped``, ``unknown_ns_pages_dropped``).

Parents first: a page is acknowledged on disk (``on_disk`` set, a ``stored``
event of tier ``disk``) only after its commit, and the tier commits a page
only if its parent page is already on disk (DiskTier.put_async). While a
node's write is in flight its path is DISK-locked, so no ancestor leaves the
disk under it; a node whose write fails part way has its committed pages
deleted. So every page acknowledged on disk, and not evicted since (a
``removed`` event), is restored after kill -9 or a power loss survived by the
environment; ``orphans_dropped`` stays 0 unless a page failed its checksum.

Faults: a damaged environment at start is moved aside (disk_env.quarantine)
and the tier starts empty (``quarantined``); a state directory that cannot be
written is an error at start; at run time a failed sidecar write or a tier
whose writes are disabled degrades the tier (``degraded`` says why, counted
in ``write_faults``, logged once): pages that cannot be made durable are not
written, reads go on, and the first write that succeeds ends it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.config import Config
from hicache.daemon.core.service import CacheService, NamespaceState, Pin
from hicache.daemon.movers.disk_jobs import PageViews, Prefetch
from hicache.daemon.movers.disk_namespaces import NamespaceFile
from hicache.daemon.movers.disk_restore import RestoreJob, adopt
from hicache.daemon.movers.disk_startup import DiskOpening, Quarantine, open_and_chain
from hicache.daemon.movers.disk_writes import HostToDisk
from hicache.index.admission import admission_key
from hicache.index.node import DISK_LANE
from hicache.index.radix import Tier, TreeNode
from hicache.tiers.disk.format import footprint
from hicache.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)

POSTED_SLICE_S = 0.002  # the longest the disk threads' completions hold the event loop at a time

class DiskMover(HostToDisk):
    def __init__(self, config: Config, service: CacheService, tier: DiskTier, loop: asyncio.AbstractEventLoop,
                 namespaces: NamespaceFile | None = None) -> None:
        self.config = config
        self.service = service
        self.tier = tier
        self.loop = loop
        self.capacity_bytes = config.disk_capacity
        self.inflight_bytes = 0
        self.inflight_by_ns: dict[bytes, int] = {}  # write-through bytes in flight per salt (quotas count them)
        self._init_writes()
        self.prefetched_pages = 0
        self.prefetch_misses = 0
        self.promoted_pages = 0  # exclusive placement: disk copies dropped as they were read back
        self._latencies: list[tuple[str, float]] = []  # (op, seconds) for the metrics sampler
        self._posted: deque[tuple[Callable[..., None], tuple]] = deque()  # see post()
        self._post_lock = threading.Lock()
        self._drain_scheduled = False
        self.namespaces = namespaces if namespaces is not None else NamespaceFile(config.state_dir)
        self.quarantine: Quarantine | None = None
        self.rebuilt = dict(restored_pages=0, orphans_dropped=0, unknown_ns_pages_dropped=0)
        self.restore: RestoreJob | None = None  # a big tier's restore while the daemon answers
        service.on_host_stored = self.write_through
        service.before_host_evict = self.demote
        service.on_disk_freed = self.delete
        service.on_match = self.prefetch
        self._next_pin_dropped = service.on_pin_dropped  # the hybrid states' hook, called first
        service.on_pin_dropped = self._pin_dropped
        if service.quotas is not None:
            service.quotas.disk_inflight = lambda ns: self.inflight_by_ns.get(ns.salt, 0)

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) on the event loop; callable from the disk threads. Completions
        of one writer batch share a single loop wake-up instead of one per page."""
        self._posted.append((fn, args))
        with self._post_lock:
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self.loop.call_soon_threadsafe(self._drain_posted)

    def _drain_posted(self) -> None:
        """Run what the disk threads posted, for at most POSTED_SLICE_S at a time: a commit
        of hundreds of batches, or completions that piled up while the loop was busy, must
        not hold every engine's request behind them."""
        with self._post_lock:
            self._drain_scheduled = False  # before draining: a later post schedules again
        posted = self._posted
        end = time.perf_counter() + POSTED_SLICE_S
        while posted:
            fn, args = posted.popleft()
            fn(*args)
            if posted and time.perf_counter() >= end:
                with self._post_lock:
                    if self._drain_scheduled:
                        return
                    self._drain_scheduled = True
                self.loop.call_soon(self._drain_posted)  # the rest after what waits on the loop
                return

    @classmethod
    def start(cls, config: Config, service: CacheService, opening: DiskOpening | None = None) -> DiskMover:
        """Open the tier (moving a damaged environment aside) and restore the index
        (disk_restore.py: at once, or for a big tier while the daemon answers); raises
        DiskTierError, in one line, when the state directory is unusable. `opening`: the
        tier opened and its records chained meanwhile (disk_startup.py)."""
        loop = asyncio.get_running_loop()
        if opening is None:
            opened, lazy = open_and_chain(config), False
        else:
            opened, lazy = opening.opened(), opening.lazy
        t0 = time.monotonic()
        tier = opened.tier
        try:
            mover = cls(config, service, tier, loop, opened.namespaces)
            mover.quarantine = opened.quarantine
            if lazy:
                mover.restore = RestoreJob(mover, opened, asyncio.wrap_future(opening.chained, loop=loop))
                loop.create_task(mover.restore.run())
                log.info("disk tier: %d pages to index while the daemon answers (opened and read in %.2fs)",
                         len(opened.scan), opened.open_s)
                return mover
            if opening is not None:
                opening.chained.result()
            n = adopt(mover, opened)
        except BaseException:
            tier.close()
            raise
        log.info("disk tier: %d pages restored (open and scan %.2fs, records checked %.2fs, index %.2fs; "
                 "%s used of %s)", n, opened.open_s, opened.chain_s, time.monotonic() - t0, tier.used_bytes,
                 config.disk_capacity)
        return mover

    def _remember(self, ns: NamespaceState) -> bool:
        return self.namespaces.remember(ns)

    def when_restored(self, fn: Callable[[], None]) -> None:
        """Run `fn` once every page on disk is indexed (now, unless a restore is running)."""
        if self.restore is None:
            fn()
        else:
            self.restore.when_restored(fn)

    # -- host -> disk ----------------------------------------------------------------
    def _host_view(self, ns: NamespaceState) -> PageViews:
        return PageViews(self.service.host.arena.array, ns.page_class.page_bytes)

    def _page_budget(self, ns: NamespaceState) -> int:
        """The page bytes the disk tier's map holds, at this namespace's footprint per
        page (the capacity is the LMDB file: hicache/tiers/disk/writer.py charges each
        page its overflow pages and B-tree records, and turns away what would not fit)."""
        page_bytes = ns.page_class.page_bytes
        charge = footprint(page_bytes, ns.index.page_size)
        return min(self.tier.capacity_bytes, self.tier.map_budget * page_bytes // charge)

    def _used_bytes(self) -> int:
        """The disk's page bytes as of now: the tier counts its deletions only once they
        commit, the index as soon as it evicts (without this, one call would evict
        everything while the first victims' deletions are still queued)."""
        indexed = sum(ns.index.num_pages(Tier.DISK) * ns.page_class.page_bytes
                      for ns in self.service.namespaces.values())
        return min(self.tier.used_bytes, indexed)

    def _make_room(self, ns: NamespaceState, nbytes: int) -> bool:
        """Evict disk LRU leaves (any namespace) until nbytes more fit the budget; under
        tenant quotas their rules choose the victims (hicache/daemon/core/quotas.py)."""
        budget = self._page_budget(ns)
        quotas = self.service.quotas
        if quotas is not None and quotas.applies("disk"):
            return quotas.make_disk_room(ns, nbytes, lambda: budget - self._used_bytes() - self.inflight_bytes)
        while (used := self._used_bytes()) + self.inflight_bytes + nbytes > budget:
            over = used + self.inflight_bytes + nbytes - budget
            if self.service.evict_tier(Tier.DISK, over) == 0:
                return False
        return True

    def _admit(self, ns: NamespaceState, node: TreeNode) -> bool:
        """The admission's verdict on writing `node` (hicache/index/admission.py)."""
        adm = self.service.admission
        if adm is None:
            return True
        nbytes = node.n_pages * ns.page_class.page_bytes
        room = self._used_bytes() + self.inflight_bytes + nbytes <= self._page_budget(ns)
        return adm.admit(admission_key(node.keys[0]), node.n_pages, room)

    def delete(self, ns: NamespaceState, keys: list[bytes]) -> None:
        self.tier.delete_async(keys)

    # -- disk -> host --------------------------------------------------------------------
    def prefetch(self, pin: Pin, disk_nodes: list[TreeNode]) -> None:
        """Start reading the disk part of a match into fresh host pages."""
        ns = pin.engine.ns
        if not disk_nodes:
            return
        # A node keeps its lower half when split, so its end position stays valid.
        nodes, end = [], 0
        for node in disk_nodes:
            end += node.n_pages
            nodes.append((node, end))
        n_pages = end
        host_pages = self.service.alloc_host(ns, n_pages)
        if host_pages is None:
            return
        ns.index.lock(disk_nodes[-1], Tier.DISK)
        pin.locks.append((disk_nodes[-1], Tier.DISK, None))
        view = self._host_view(ns)
        keys = [k for node in disk_nodes for k in node.keys]
        outs = [view.page_view(int(slot)) for slot in host_pages]
        pf = Prefetch(nodes, host_pages, None)
        pin.prefetch = pf
        fut = asyncio.wrap_future(self.tier.get_many_async(ns.salt, keys, outs), loop=self.loop)
        pf.future = fut
        fut.add_done_callback(lambda f: self._prefetched(pin, f))

    def take_latencies(self) -> list[tuple[str, float]]:
        out, self._latencies = self._latencies, []
        return out

    def _prefetched(self, pin: Pin, fut: asyncio.Future) -> None:
        pf = pin.prefetch
        seconds = time.monotonic() - pf.started
        if len(self._latencies) < 10000:
            self._latencies.append(("prefetch", seconds))
        ns = pin.engine.ns
        index = ns.index
        pf.done = True
        try:
            hits = fut.result()
        except Exception:
            log.exception("disk prefetch failed")
            hits = [False] * len(pf.host_pages)
        else:
            if self.service.fetch_cost is not None:  # the tier's read speed: fetch or recompute
                self.service.fetch_cost.observe("disk", len(pf.host_pages) * ns.page_class.page_bytes, seconds)
        if pin.pin_id not in self.service.pins:  # released (or its engine left) meanwhile
            ns.page_class.free(pf.host_pages)
            return
        hits_arr = np.asarray(hits, dtype=bool)
        first_miss = int(np.argmin(hits_arr)) if not hits_arr.all() else len(hits_arr)
        used = 0
        last = None
        stored: list[TreeNode] = []
        for node, end in pf.nodes:  # whole nodes whose every page arrived
            if end > first_miss or node.removed:
                break
            used, last = end, node
            stored.append(node)
        if last is not None:
            # pages some other path brought to host meanwhile come back as duplicates: spare
            dups = index.set_host(last, pf.host_pages[:used].copy())
            if len(dups):
                ns.page_class.free(dups)
        if used < len(pf.host_pages):
            ns.page_class.free(pf.host_pages[used:])
        if first_miss < len(hits_arr):
            self.prefetch_misses += 1
            missing = next(n for n, end in pf.nodes if end > first_miss)
            # a page the index thought was on disk is not (failed write, corrupt page): forget it
            self.service.drop_disk_copy(ns, missing)
        self.prefetched_pages += used
        pf.loaded_pages = used
        pf.last_node = last
        if last is not None:
            index.lock(last, Tier.HOST)
            pin.locks.append((last, Tier.HOST, None))
        if stored:
            self.service.emit_nodes("stored", Tier.HOST, None, stored, ns)
            if self.config.disk_placement == "exclusive":
                pf.promoted = stored

    def _pin_dropped(self, pin: Pin) -> None:
        """Exclusive placement: the pages a request read back from disk leave it, now that
        its locks are gone: deepest first, stopping at a page that is locked (another
        request reads it) or has a page below it on disk (a page is on disk only under
        its parent)."""
        if self._next_pin_dropped is not None:
            self._next_pin_dropped(pin)
        pf = pin.prefetch
        if pf is None or not pf.promoted:
            return
        ns = pin.engine.ns
        dropped: list[TreeNode] = []
        for node in reversed(pf.promoted):
            if (node.removed or not node.on_disk or node.host is None or node.lock_ref[Tier.DISK]
                    or node.child_lanes.get(DISK_LANE)):
                break
            keys = list(node.keys)
            ns.index.set_disk(node, False)
            self.tier.delete_async(keys)
            self.promoted_pages += len(keys)
            dropped.append(node)
        pf.promoted = []
        if dropped:
            self.service.emit_nodes("removed", Tier.DISK, None, dropped, ns)

    async def wait_prefetch(self, pin: Pin, policy: str, timeout_s: float) -> None:
        pf = pin.prefetch
        if pf is None or pf.done or pf.future is None:
            return
        if policy == "wait_complete":
            await asyncio.shield(pf.future)
        elif policy == "timeout":
            try:
                await asyncio.wait_for(asyncio.shield(pf.future), timeout_s)
            except asyncio.TimeoutError:
                pass
        if not pf.done:  # the callback runs on the next loop turn after the future resolves
            await asyncio.sleep(0)

    # -- lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        st = self.tier.stats()
        q = self.quarantine
        degraded = "; ".join(x for x in (st["write_fault"], self.namespaces.fault) if x)
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": st["used_bytes"], "pages": st["num_pages"],
                "queue_depth": st["queue_depth"], "backlog_pages": self.backlog_pages,
                "backlogged_writes": self.backlogged_writes,
                "skipped_writes": self.skipped_writes + st["skipped_queue_full"] + st["skipped_disabled"],
                "demoted_pages": self.demoted_pages, "placement": self.config.disk_placement,
                "promoted_pages": self.promoted_pages,
                "admission": self.service.admission.stats() if self.service.admission is not None else None,
                "prefetched_pages": self.prefetched_pages,
                "prefetch_misses": self.prefetch_misses, "corrupt_pages": st["corrupt_pages"],
                "bytes_written": st["bytes_written"], "bytes_read": st["bytes_read"],
                # the index's disk evictions (budget, quotas, evict_tier); the writer counts only
                # those its own evict hook chose, and the daemon sets none
                "evicted_pages": self.service.counters.evicted_pages["disk"] + st["evicted_pages"],
                "last_write_time": st["last_write_time"],
                "durability": st["durability"], "rejected_budget": st["rejected_budget"],
                "rejected_orphan": st["rejected_orphan"], **self.rebuilt,
                "restoring": self.restore is not None and not self.restore.done,
                "quarantined": int(q is not None), "quarantine_path": q.path if q else None,
                "quarantine_reason": q.reason if q else None,
                "writable": not degraded, "degraded": degraded, "write_faults": st["write_faults"] + self.namespaces.faults}

    def close(self) -> None:
        self.tier.flush(timeout_s=60)
        self.tier.close()
