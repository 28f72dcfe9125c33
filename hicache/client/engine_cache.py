"""EngineCache: what an engine's scheduler calls. It owns the bookkeeping of
which device pages belong to the cache and which to a request.

A device page is, at any moment, one of:
  free     - in the engine's allocator;
  private  - held by one request only (freshly computed, or a duplicate);
  cached   - the daemon records it as this engine's residency ("owned");
             requests using it hold a ref, and the daemon keeps it locked
             through their pins, so eviction never takes a page in use;
  in doubt - offered by an insert the daemon answered late: it may record it,
             so it is never freed until the answer comes (then cached, or
             freed once no request holds it) or the connection is gone.
Pages move private -> cached at `store` (insert) and `finish_load`, cached
-> free when the daemon evicts them, and cached -> private for every page at
once when the daemon is lost: a reconnect registers a new engine (the daemon
drops the old one's residency when it sees the old connection close), and an
unreachable daemon cannot give pages back, so under pool pressure the engine
takes them back itself (they are only a cache; no lookup hits them while the
daemon is away). Idle pages are freed then; pages live requests hold are
freed at their release. Pages are never freed while a copy reads or writes
them, and no copy into or out of the daemon's host pages outlives the
connection that planned it (`_on_disconnect`).

The per-layer pipeline: `lookup` starts the host->device copy of the host
part on the transfer executor and returns a Prefix whose `wait_layer(l)` the
model calls right before layer l reads the pool.

Round trips. A request waits on the daemon twice: `match` (lookup) and
`insert` (store), plus `evict` when the pool runs short and `load` when part of
the prefix is on disk. Its other reports are posted, sent without waiting for
the answer (RpcConnection.post): `load_done`, a write-through `backup_done` and
`release`. Posting never lets the daemon act sooner than a waited call would:
each report is sent only after the copy it reports has ended, and until the
daemon handles it, it keeps what that copy needed (the pin's host lock on the
pages a load read; the reserved host pages a backup wrote; for a release, the
pin's locks). The daemon handles a connection's frames in order, so every later
call of this engine (insert, evict, the next match) finds them done. A
write-back eviction's `backup_done` is waited for: its answer frees pages now.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache.client.client import EMPTY, BackupPlan, HiCacheClient, InsertReply, Match
from hicache.client.replies import LATE
from hicache.errors import HiCacheError
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostKVCache, check_dma_min_run_pages
from hicache.transfer.executor import LoadHandle, TransferExecutor

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Prefix:
    """A request's cached prefix: its device pages, some possibly still loading."""

    match: Match
    device_pages: np.ndarray  # resident pages, then the pages being loaded from host
    load: LoadHandle | None
    loaded_pages: np.ndarray  # the part of device_pages being loaded
    epoch: int
    private: list[np.ndarray] = field(default_factory=list)  # pages only this request holds
    cached: list[np.ndarray] = field(default_factory=list)  # cached pages it holds a ref on
    finished: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)

    def wait_layer(self, layer_id: int) -> None:
        if self.load is not None:
            self.load.wait_layer(layer_id)


class EngineCache:
    def __init__(self, client: HiCacheClient, device_pool: DevicePool, allocator: Any, *,
                 dma_min_run_pages: int | None = None) -> None:
        """`dma_min_run_pages` (default: $HICACHE_DMA_MIN_RUN_PAGES, else off) sends runs of at
        least that many consecutive pages by DMA instead of the copy kernel (see HostKVCache)."""
        self.client = client
        env = os.environ.get("HICACHE_DMA_MIN_RUN_PAGES", "").strip()
        if dma_min_run_pages is None and env:
            try:
                dma_min_run_pages = int(env)
            except ValueError:
                raise HiCacheError(f"HICACHE_DMA_MIN_RUN_PAGES must be an integer, got {env!r}") from None
        self.dma_min_run_pages = check_dma_min_run_pages(dma_min_run_pages)  # before connecting
        self.pool = device_pool
        self.allocator = allocator
        self.page_size = device_pool.page_size
        n = device_pool.num_pages + 1
        self.cached = np.zeros(n, dtype=bool)  # the daemon tracks this page as our residency
        # offered by an insert whose answer is late: the daemon may track it, so it is never
        # freed until the answer says (`_late_insert`) or the connection is gone
        self.doubt = np.zeros(n, dtype=bool)
        self.refs = np.zeros(n, dtype=np.int32)  # live requests holding the page
        self.backups: list[tuple[BackupPlan, Any, TransferExecutor]] = []
        self.host: HostKVCache | None = None
        self.executor: TransferExecutor | None = None
        self._epoch = 0
        client.on_reconnect.append(self._on_reconnect)
        client.on_disconnect.append(self._on_disconnect)
        client.connect()

    # -- epochs ------------------------------------------------------------------
    def _on_reconnect(self, epoch: int) -> None:
        """A (new) daemon: view its arena (the client maps our slabs of it), and forget
        what an old one tracked."""
        self._drain_backups(report=False)
        if self.executor is not None:
            self.executor.close()
        assert self.client.arena is not None
        self.host = HostKVCache(self.pool.layout, self.client.arena, dma_min_run_pages=self.dma_min_run_pages)
        self.executor = TransferExecutor(self.host, self.pool)
        if self._epoch:
            self._forget_residency("hicache daemon reconnected")
        self._epoch = epoch

    def _on_disconnect(self) -> None:
        """The client drops the connection: once the daemon sees it close it frees the host
        pages of our pins and backups, so every copy into or out of them must end first."""
        if self.executor is not None:
            self.executor.wait_idle()

    def _forget_residency(self, why: str) -> int:
        """The daemon no longer tracks our device residency: every cached page is ours alone.
        Idle ones are freed now, those live requests hold at their release. Returns how many
        were freed."""
        self._drain_backups(report=False)  # a backup may still read pages about to be freed
        doubted = np.flatnonzero(self.doubt)  # a late insert's answer will never come now
        self.doubt[doubted] = False
        self._free(doubted[(self.refs[doubted] == 0) & ~self.cached[doubted]])
        lost = np.flatnonzero(self.cached)
        if not len(lost):
            return 0
        self.cached[lost] = False
        idle = lost[self.refs[lost] == 0]
        self._free(idle)
        log.warning("%s: %d cached pages released, %d stay with live requests", why, len(idle),
                    len(lost) - len(idle))
        return len(idle)

    # -- allocation helpers --------------------------------------------------------
    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        base = torch.from_numpy(np.asarray(pages, dtype=np.int64)) * self.page_size
        return (base[:, None] + torch.arange(self.page_size)).reshape(-1).to(self.pool.device)

    def _free(self, pages: np.ndarray) -> None:
        if len(pages):
            self.allocator.free(self._slots(pages))

    def alloc_pages(self, n: int) -> np.ndarray | None:
        """n device pages, asking the daemon to give back cached pages if the pool is short."""
        if n == 0:
            return EMPTY
        slots = self.allocator.alloc(n * self.page_size)
        if slots is None:
            self.evict(n - self.allocator.available_size() // self.page_size)
            slots = self.allocator.alloc(n * self.page_size)
            if slots is None:
                return None
        return (slots[::self.page_size] // self.page_size).cpu().numpy().astype(np.int64)

    # -- lookup and load -----------------------------------------------------------
    def lookup(self, tokens: Any) -> Prefix:
        """The cached prefix of `tokens`: device pages already resident, plus a host part
        whose per-layer copy starts now. Call `finish_load` after the forward pass."""
        self.poll()
        m = self.client.match(tokens)
        resident = m.device_pages
        self.refs[resident] += 1
        prefix = Prefix(m, resident, None, EMPTY, m.epoch, cached=[resident])
        if m.host_len and self.executor is not None and self._mapped(m.host_pages):
            pages = self.alloc_pages(m.host_len)
            if pages is not None:
                prefix.load = self.executor.load(m.host_pages, pages)
                prefix.loaded_pages = pages
                prefix.device_pages = np.concatenate([resident, pages])
                self.refs[pages] += 1
        return prefix

    def finish_load(self, prefix: Prefix) -> None:
        """The loaded pages are in place: record them with the daemon as cached.

        The report is posted, not waited for (no round trip), and only once the copy
        ended. The pin keeps the host pages it was loaded from locked until the daemon
        handles the report, which it does before any later call of this engine (insert,
        evict, release: one connection, handled in order), so those see the new device
        pages recorded. Pages this engine turns out to hold twice come back through `evict`."""
        if prefix.load is None:
            return
        prefix.load.wait()  # the copy ended: only now may the daemon unlock its source
        pages = prefix.loaded_pages
        dups = (self.client.load_done(prefix.match, pages, wait=False) if prefix.epoch == self.client.epoch
                else None)
        if dups is None:  # daemon lost: the copies are valid, but only this request knows them
            prefix.private.append(pages)
        else:
            mine = pages[~np.isin(pages, dups)]
            self.cached[mine] = True
            prefix.cached.append(mine)
            prefix.private.append(dups)
        prefix.load = None

    # -- store -------------------------------------------------------------------------
    def store(self, prefix: Prefix, tokens: Any, new_pages: np.ndarray,
              states: dict[int, int] | None = None) -> InsertReply | None:
        """Offer the request's full pages (prefix pages, then `new_pages`) to the cache, and
        for a hybrid model its state checkpoints (`states`: position -> device state slot;
        the reply's state_backup says which to copy where). Returns the daemon's reply
        (None: skipped)."""
        all_pages = np.concatenate([prefix.device_pages, new_pages])
        n_full = len(np.asarray(tokens)) // self.page_size
        all_pages = all_pages[:n_full]
        self.refs[new_pages] += 1
        reply = None
        if prefix.epoch == self.client.epoch:
            offered = new_pages[np.isin(new_pages, all_pages)]
            reply = self.client.insert(tokens, all_pages, keys=prefix.match.keys[:n_full], pin=prefix.match,
                                       states=states, on_late=lambda r: self._late_insert(offered, r))
        if reply is LATE:  # whether the daemon took them is known once its answer comes
            self.doubt[offered] = True
            reply = None
        if reply is None:
            prefix.private.append(new_pages)
            return None
        dups = reply.free_pages[~self.cached[reply.free_pages]]  # our own cached pages are no duplicates
        fresh = new_pages[~np.isin(new_pages, dups)]
        fresh = fresh[np.isin(fresh, all_pages)]
        self.cached[fresh] = True
        prefix.cached.append(fresh)
        prefix.private.append(new_pages[~np.isin(new_pages, fresh)])
        if reply.backup is not None:
            if self.executor is not None and self._mapped(reply.backup.host_pages):
                handle = self.executor.backup(reply.backup.host_pages, reply.backup.device_pages)
                self.backups.append((reply.backup, handle, self.executor))
            else:
                self._report_failed(reply.backup)
        return reply

    def _late_insert(self, offered: np.ndarray, reply: InsertReply | None) -> None:
        """The late answer of an insert (None: refused): the pages it adopted become cached,
        the rest stop being in doubt; those no request holds any more are freed."""
        self.doubt[offered] = False
        if reply is not None:
            dups = reply.free_pages[~self.cached[reply.free_pages]]
            self.cached[offered[~np.isin(offered, dups)]] = True
        self._free(offered[(self.refs[offered] == 0) & ~self.cached[offered]])

    @property
    def arena(self) -> HostArena | None:
        """The daemon's host arena as mapped here (None before the first connect): only
        the slabs of our namespace are backed."""
        return self.client.arena

    def _mapped(self, host_pages: np.ndarray) -> bool:
        """Whether we may copy to or from the host pages of a plan: the connection that made
        it lives (the daemon frees a dropped connection's pages) and they lie in slabs mapped
        here (else the client could not map a slab). Otherwise the plan is skipped."""
        if not self.client.connected:
            return False
        arena = self.client.arena
        if arena is not None and arena.covers(host_pages, self.pool.layout.page_bytes):
            return True
        log.warning("a plan names host pages outside the slabs mapped here; skipped")
        return False

    def release(self, prefix: Prefix) -> None:
        """The request is done: drop its pin and refs, free its private pages."""
        if prefix.finished:
            return
        prefix.finished = True
        if prefix.load is not None:  # loaded but never committed: the copies are this request's
            prefix.load.wait()  # never free pages a copy is still writing
            prefix.private.append(prefix.loaded_pages)
            prefix.load = None
        self.client.release(prefix.match, wait=False)  # nothing here needs the answer: no round trip
        for pages in prefix.cached:
            self.refs[pages] -= 1
        for pages in prefix.private:
            self.refs[pages] -= 1
        private = np.concatenate(prefix.private) if prefix.private else EMPTY
        private = private[~self.cached[private] & ~self.doubt[private]]  # a late insert's answer decides those
        orphaned = np.concatenate(prefix.cached) if prefix.cached else EMPTY
        orphaned = orphaned[(~self.cached[orphaned]) & (self.refs[orphaned] == 0)]
        self._free(np.unique(np.concatenate([private, orphaned])))

    # -- backups and eviction ---------------------------------------------------------
    def poll(self) -> None:
        """Report finished backups (never blocks)."""
        still = []
        for plan, handle, ex in self.backups:
            if handle.done():
                self._report_backup(plan, handle)
            else:
                still.append((plan, handle, ex))
        self.backups = still

    def _report_backup(self, plan: BackupPlan, handle: Any, wait: bool = False) -> None:
        """Report a backup once its copy ended. Insert's backups free no device pages, so
        their report is posted (no round trip; the daemon keeps their host pages reserved
        until it handles it); an eviction's (`wait`) frees the pages it copied out."""
        try:
            handle.wait()
            ok = True
        except Exception:
            log.exception("backup %d failed", plan.backup_id)
            ok = False
        freed = self.client.backup_done(plan, ok, wait=wait)
        if freed is not None and len(freed):
            self._release_cached(freed)

    def _report_failed(self, plan: BackupPlan, wait: bool = False) -> None:
        """A backup plan we cannot carry out: the daemon drops its host pages."""
        freed = self.client.backup_done(plan, ok=False, wait=wait)
        if freed is not None and len(freed):
            self._release_cached(freed)

    def wait_backups(self) -> None:
        """Block until every started backup is done and reported (replays use it so that
        each request sees the same cache state, whatever the copies' timing), and until the
        daemon has handled the releases sent without waiting."""
        self._drain_backups(report=True)
        self.client.wait_posted()

    def _drain_backups(self, report: bool) -> None:
        for plan, handle, _ in self.backups:
            if report:
                self._report_backup(plan, handle)
            else:
                try:
                    handle.wait()
                except Exception:
                    pass
        self.backups = []

    def _release_cached(self, pages: np.ndarray) -> None:
        pages = pages[self.cached[pages]]
        self.cached[pages] = False
        self._free(pages[self.refs[pages] == 0])

    def evict(self, num_pages: int) -> int:
        """Give about num_pages cached device pages back to the allocator; returns how many.
        With the daemon unreachable, every idle cached page goes (see the module docstring)."""
        if num_pages <= 0:
            return 0
        self.poll()
        free_now, plan = self.client.evict(num_pages)  # on a parked reconnect: adopts it, frees all
        n = len(free_now)
        self._release_cached(free_now)
        if plan is not None:  # write-back: copy out first
            before = self.allocator.available_size()
            if self.executor is not None and self._mapped(plan.host_pages):
                self._report_backup(plan, self.executor.backup(plan.host_pages, plan.device_pages), wait=True)
            else:
                self._report_failed(plan, wait=True)
            n += (self.allocator.available_size() - before) // self.page_size
        if not self.client.connected:
            n += self._forget_residency("hicache daemon unreachable")
        return n

    def close(self) -> None:
        self._drain_backups(report=True)
        self.client.wait_posted()  # the daemon has the posted reports before it sees the close
        if self.executor is not None:
            self.executor.close()
        self.client.close()
