"""Host -> disk: the write-through, its backlog, and demotion (the writes of DiskMover).

- Write-through: once pages become host-resident (a backup or a put finished)
  they are queued for disk straight from their arena slots (no copy); the node
  is HOST-locked until the write commits, so its slots cannot be reused under
  the writer, and DISK-locked, so no page above it leaves the disk first.
- Written through means written. A full queue delays a write, it does not drop
  it: the write waits in the *backlog*, in order, and goes to the tier's queue as
  that drains (each commit reported back drains the backlog first; a short
  timer when none of ours is queued). Its host copy stays locked meanwhile, so
  the host never evicts a page before it is on disk: under a fill faster than
  the disk, pages wait on host, and once the host holds nothing else it can
  evict, new stores are refused (their put finds no room: `puts.skipped_no_space`)
  rather than accepted and lost. A page is still not written when the disk is
  full by policy (its budget, the admission) or degraded (a fault; counted in
  `skipped_writes`).
  Why written when the queue drains, not "before the host evicts it": eviction
  runs inside an allocation on a request's path, so writing then means copying
  the victim's bytes aside (memory without bound while the disk lags) or
  waiting for the disk on the event loop. Holding the host copy costs neither,
  and the backlog is bounded by the host arena. `stats` shows it
  (`tiers.disk.backlog_pages`, next to `queue_depth`).
- Demotion: before host eviction, victims not on disk yet (pages the admission
  turned away at write-through, or all of them under a non-inclusive placement)
  are copied out and queued, their slots being about to be reused. A copy does
  not wait in the backlog (its bytes would): while writes are backlogged, or
  when the queue does not take it whole, it is shed and counted in
  `skipped_writes` (the page leaves the cache, as the placement allows).
- Parents first: a page is written only under a parent already on disk or
  queued before it (the tier refuses an orphan), so the unwritten pages above a
  node are queued first, and the backlog keeps queue order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.core.service import NamespaceState
from hicache.daemon.movers.disk_jobs import DiskWrite, PageViews
from hicache.index.radix import Tier, TreeNode

if TYPE_CHECKING:
    from hicache.config import Config
    from hicache.daemon.core.service import CacheService
    from hicache.tiers.disk.tier import DiskTier

DRAIN_RETRY_S = 0.005  # a backlog with none of our pages queued (the queue full of others') is retried after this


class HostToDisk:
    """Mixed into DiskMover (hicache/daemon/movers/disk_mover.py), which owns the budget and the hooks."""

    if TYPE_CHECKING:  # DiskMover's
        config: Config
        service: CacheService
        tier: DiskTier
        loop: asyncio.AbstractEventLoop
        inflight_bytes: int
        inflight_by_ns: dict[bytes, int]
        _latencies: list[tuple[str, float]]

        def post(self, fn: Callable[..., None], *args: Any) -> None: ...
        def _remember(self, ns: NamespaceState) -> bool: ...
        def _make_room(self, ns: NamespaceState, nbytes: int) -> bool: ...
        def _admit(self, ns: NamespaceState, node: TreeNode) -> bool: ...
        def _host_view(self, ns: NamespaceState) -> PageViews: ...

    def _init_writes(self) -> None:
        self.writes: dict[int, DiskWrite] = {}  # accepted, not committed yet (the backlog's included)
        self._wid = 0
        self._writing: dict[int, int] = {}  # id(node) -> its write's id, while it has one
        self.backlog: deque[DiskWrite] = deque()  # write-through waiting for room in the tier's queue
        self.backlog_pages = 0  # of the backlog, pages not handed to the tier yet
        self.backlogged_writes = 0  # writes that had to wait (a counter)
        self._handed_pages = 0  # pages of ours in the tier's queue, not reported back yet
        self._drain_timer: asyncio.TimerHandle | None = None
        self.skipped_writes = 0
        self.demoted_pages = 0

    # -- write-through --------------------------------------------------------------------
    def write_through(self, ns: NamespaceState, nodes: list[TreeNode]) -> None:
        if self.config.disk_placement != "inclusive":
            return  # (non-)exclusive: pages go down as the host evicts them (demote)
        todo = [n for n in nodes if not n.on_disk and n.host is not None]
        todo = [n for n in todo if self._admit(ns, n)]  # a page turned away may still go down on eviction
        if not todo:
            return
        if not self._remember(ns):
            self.skipped_writes += sum(n.n_pages for n in todo)
            return
        for node in todo:  # parents before children: the order the tier must commit them in
            self._write_path(ns, node)

    def write_pinned(self, ns: NamespaceState, node: TreeNode) -> None:
        """A disk pin (hicache/index/pins.py) on pages not on disk yet: written now, whatever
        the placement and the admission say."""
        if node.on_disk or node.host is None or not self._remember(ns):
            return
        self._write_path(ns, node)

    def _unwritten_above(self, node: TreeNode) -> list[TreeNode] | None:
        """The ancestors of `node` that must be written before it, top first: the tier
        commits a page only under a committed parent, and a parent's disk copy may have
        been evicted (or its write skipped) while its host copy stayed. None when one of
        them is on no tier the daemon can write from (only on a device)."""
        chain: list[TreeNode] = []
        x = node.parent
        while x is not None and x.keys and not x.on_disk and id(x) not in self._writing:
            if x.host is None:
                return None
            chain.append(x)
            x = x.parent
        chain.reverse()
        return chain

    def _write_path(self, ns: NamespaceState, node: TreeNode) -> bool:
        """Accept `node` (host-resident, not on disk) for writing through, after whatever
        of its path above is not on disk yet; False when it could not be."""
        if id(node) in self._writing:  # accepted already (as the parent of an earlier one)
            return True
        above = self._unwritten_above(node)
        if above is None:
            self.skipped_writes += node.n_pages
            return False
        page_bytes = ns.page_class.page_bytes
        for x in [*above, node]:
            if not self._make_room(ns, x.n_pages * page_bytes):
                self.skipped_writes += node.n_pages if x is not node else x.n_pages
                return False
            slots = np.asarray(x.host[:x.n_pages], dtype=np.int64)
            ns.index.lock(x, Tier.HOST)  # its slots stay put under the writer
            ns.index.lock(x, Tier.DISK)  # no ancestor leaves the disk before this commits
            w = self._register(ns, x, slots, None, demote=False)
            if self.backlog:
                self._drain()
            if self.backlog or not self._hand(w):
                if not self._hand_failed(w):
                    self.backlog.append(w)
                    self.backlog_pages += w.n_pages - w.handed
                    self.backlogged_writes += 1
                    self._arm_drain()
        return True

    # -- the tier's queue -----------------------------------------------------------------
    def _register(self, ns: NamespaceState, node: TreeNode, slots: np.ndarray | None, rows: np.ndarray | None,
                  demote: bool) -> DiskWrite:
        n = node.n_pages
        parent = node.parent.keys[-1] if node.parent is not None and node.parent.keys else None
        self._wid += 1
        w = DiskWrite(self._wid, ns, node, node.keys[:n], parent, node.tokens[:n * ns.index.page_size],
                      slots, rows, n, n, started=time.monotonic(), demote=demote)
        self.writes[w.wid] = w
        self._writing[id(node)] = w.wid
        nbytes = n * ns.page_class.page_bytes
        self.inflight_bytes += nbytes
        if not demote:  # a demoted page counts on disk from its queueing (set_disk)
            self.inflight_by_ns[ns.salt] = self.inflight_by_ns.get(ns.salt, 0) + nbytes
        return w

    def _hand(self, w: DiskWrite) -> bool:
        """Hand the tier's queue as many of w's pages as it takes now, as one batch
        (DiskTier.put_many_async: one queue item, one completion), straight from their
        arena slots or from the copy a demotion took; True once all are handed."""
        lo = w.handed
        if not w.ok:  # a part already failed: the rest would be orphans
            return False
        ns = w.ns
        if w.rows is not None:
            src, rows = w.rows[lo:], None
        else:
            src, rows = self._host_view(ns).rows(), w.slots[lo:]
        wid = w.wid
        got = self.tier.put_many_async(ns.salt, w.keys[lo:], w.parent if lo == 0 else w.keys[lo - 1],
                                       w.tokens[lo * ns.index.page_size:], src,
                                       lambda oks: self.post(self._pages_written, wid, oks, True), rows=rows,
                                       count_refused=False)
        w.handed += got
        self._handed_pages += got
        return w.handed == w.n_pages

    def _hand_failed(self, w: DiskWrite) -> bool:
        """After `_hand` took less than all: give the rest up (True) when waiting cannot help
        -- a part failed, or the tier's writes are disabled by a fault -- else False."""
        if w.ok and self.tier.writable:
            return False
        rest = w.n_pages - w.handed
        self.skipped_writes += rest
        w.handed = w.n_pages
        self.post(self._pages_written, w.wid, [False] * rest, False)
        return True

    def _drain(self) -> None:
        """Hand the backlog to the tier's queue, in order, while it takes it."""
        backlog = self.backlog
        while backlog:
            w = backlog[0]
            before = w.handed
            done = self._hand(w) or self._hand_failed(w)
            self.backlog_pages -= w.handed - before
            if not done:
                break
            backlog.popleft()
        self._arm_drain()

    def _arm_drain(self) -> None:
        """Commits of our pages drain the backlog; with none queued, a timer does."""
        if self.backlog and not self._handed_pages and self._drain_timer is None:
            self._drain_timer = self.loop.call_later(DRAIN_RETRY_S, self._drain_tick)

    def _drain_tick(self) -> None:
        self._drain_timer = None
        self._drain()

    def _pages_written(self, wid: int, oks: list[bool], handed: bool) -> None:
        w = self.writes.get(wid)
        if w is None:
            return
        if handed:
            self._handed_pages -= len(oks)
        nbytes = len(oks) * w.ns.page_class.page_bytes
        self.inflight_bytes -= nbytes
        if not w.demote:
            left = self.inflight_by_ns.get(w.ns.salt, 0) - nbytes
            if left > 0:
                self.inflight_by_ns[w.ns.salt] = left
            else:
                self.inflight_by_ns.pop(w.ns.salt, None)
        w.ok &= all(oks)
        w.remaining -= len(oks)
        if not w.remaining:
            self._written(w)
        if self.backlog:
            self._drain()

    def _written(self, w: DiskWrite) -> None:
        """Every page of `w` is committed or refused."""
        del self.writes[w.wid]
        if self._writing.get(id(w.node)) == w.wid:
            del self._writing[id(w.node)]
        if len(self._latencies) < 10000:
            self._latencies.append(("demote" if w.demote else "write", time.monotonic() - w.started))
        index, node = w.ns.index, w.node
        if w.demote:
            if w.ok and node.on_disk and not node.removed:
                self.service.emit_nodes("stored", Tier.DISK, None, [node], w.ns)
            return  # a failed one is a disk miss at prefetch, which clears the flag
        if w.ok and not node.removed:
            # covers the node even if it was split meanwhile (its lower part keeps the identity)
            index.set_disk(node, True, w.n_pages)
            self.service.emit_nodes("stored", Tier.DISK, None, [node], w.ns)
        elif not node.removed:
            self.tier.delete_async(self._unclaimed(w))  # the pages committed before the one that failed
        index.unlock(node, Tier.DISK)
        index.unlock(node, Tier.HOST)
        self.service.reap(w.ns)

    def _unclaimed(self, w: DiskWrite) -> list[bytes]:
        """The keys of a failed write that nothing else holds on disk. Its pages are the last
        n of the path ending at its node (a split keeps the lower part's identity), and a
        node split off above it meanwhile may be on disk, or on its way there by another
        write: a write in flight DISK-locks its path, and one queued before the split
        covers the pages above its node too. Those stay: deleting them would leave that
        node's children on disk without their parent (orphans, dropped at the next start).
        Still under this write's own DISK lock (one ref on each node of its path)."""
        keys: list[bytes] = []
        left, x = w.n_pages, w.node
        while left > 0 and x is not None and x.keys:
            take = min(left, len(x.keys))
            if not x.on_disk and x.lock_ref[Tier.DISK] <= 1:
                keys.extend(x.keys[len(x.keys) - take:])
            left -= take
            x = x.parent
        return keys

    # -- demotion ---------------------------------------------------------------------------
    def demote(self, ns: NamespaceState, num_pages: int) -> None:
        """Before host eviction: copy victims that are not on disk yet into the write queue."""
        victims = [v for v in ns.index.select_victims(Tier.HOST, num_pages) if not v.on_disk]
        victims = [v for v in victims if self._admit(ns, v)]  # the rest leave the cache
        if not victims:
            return
        if self.backlog or not self._remember(ns):  # a full queue: nothing is copied aside
            self.skipped_writes += sum(v.n_pages for v in victims)
            return
        view = self._host_view(ns).rows()
        for node in victims:
            if id(node) in self._writing:  # written through just now, as a parent of an earlier victim
                continue
            above = self._unwritten_above(node)
            if above is None or (above and not self._write_path(ns, above[-1])) or self.backlog:
                self.skipped_writes += node.n_pages  # its parents stay on host, or wait in the backlog
                continue
            if not self._make_room(ns, node.n_pages * ns.page_class.page_bytes):
                self.skipped_writes += node.n_pages
                continue
            rows = view[np.asarray(node.host[:node.n_pages], dtype=np.int64)]  # the slots are reused right after
            w = self._register(ns, node, None, rows, demote=True)
            if self._hand(w):
                # Flagged now so the node survives losing its host copy; acknowledged (a `stored`
                # event) once committed. A write that fails shows up as a disk miss at prefetch,
                # which clears the flag.
                ns.index.set_disk(node, True)
                self.demoted_pages += w.n_pages
                continue
            handed = w.handed
            w.ok = False
            self._hand_failed(w)  # no backlog for copies: what the queue did not take is shed
            if handed:
                self.tier.delete_async(w.keys[:handed])  # the node goes: nothing would own them

    # -- shutdown -----------------------------------------------------------------------------
    async def settle(self, timeout_s: float) -> bool:
        """Wait until every write accepted so far is committed (the backlog included);
        False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.writes:
            if time.monotonic() >= deadline:
                return False
            await asyncio.to_thread(self.tier.flush, max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(0.001)  # their commits come back on this loop
        return True
