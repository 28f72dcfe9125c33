"""The disk tier's records put back on the namespaces' indexes at start (DiskMover's rebuild).

Two ways, one result (every record checked and chained as hicache/index/restore.py says):

- `adopt` (a tier of at most `restore_sync_pages` pages, ~0.1 s of work): the opening
  thread (disk_startup.py) built each namespace's index whole; the daemon takes them
  before it answers anything.
- `RestoreJob` (a bigger one): the daemon answers at once, and the runs the opening
  thread chains meanwhile are hung on the live indexes in slices of the event loop
  (SLICE_S at a time), between requests. Until a page is hung a `match` does not find
  it on disk: a miss, recomputed and stored again (the disk keeps one copy: the put is
  a duplicate). A run whose parent left the disk or the tree between two slices (evicted)
  is not hung, and neither is anything below it: their records are deleted, as the next
  start would drop them (a page is on disk only below its parent). A namespace being
  restored is not forgotten for having no engine (NamespaceState.restoring). What waits
  for the whole index -- the hybrid models' state checkpoints, the pins of the pins file --
  runs when the last run is hung (`when_restored`). `stats` says `restoring`.

Why: at a million pages checking, chaining and hanging the records is ~0.7 s of CPU after
the records are read, about a third of a restart (docs/benchmarks.md, "A million pages");
at ten million ~7 s. A cache that answers during it answers misses, never wrong pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hicache.daemon.movers.disk_startup import OpenedDisk, SaltRecords
from hicache.index.restore import hang_steps

DiskMover = Any  # hicache/daemon/movers/disk_mover.py's, which imports this module

log = logging.getLogger(__name__)

SLICE_S = 0.002  # the longest the restore holds the event loop at a time


def adopt(mover: DiskMover, opened: OpenedDisk) -> int:
    """Put the indexes the opening thread built (or, where it built none, the records it
    chained) in the service, before the daemon answers; the pages restored."""
    restored = 0
    unknown: list[SaltRecords] = []
    for group in opened.salts:
        ns = mover.service.namespace_state(group.namespace, group.index) if group.namespace is not None else None
        if ns is None:
            unknown.append(group)
            continue
        orphans = list(group.malformed)
        if group.index is not None and ns.index is group.index:
            restored += group.restored
        else:
            restored += ns.index.restore_packed(group.chained or group.records, orphans)
        _drop(mover, orphans, "whose prefix is gone", "orphans_dropped")
    _finish(mover, opened, unknown, restored)
    return restored


class RestoreJob:
    """A big tier's restore while the daemon answers (module docstring)."""

    def __init__(self, mover: DiskMover, opened: OpenedDisk, chained: asyncio.Future) -> None:
        self.mover = mover
        self.opened = opened
        self.chained = chained  # the opening thread's second half (disk_startup.DiskOpening.chained)
        self.done = False
        self.finished = asyncio.Event()  # set with `done` (settle waits for it)
        self.started = time.monotonic()
        self.hung_pages = 0
        self._then: list[Callable[[], None]] = []
        # the namespaces exist from now on, and are not forgotten before their pages are back
        self.states = [(group, mover.service.namespace_state(group.namespace)) for group in opened.salts
                       if group.namespace is not None]
        for _, ns in self.states:
            ns.restoring = True

    async def wait(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every run is hung; whether they all are."""
        try:
            await asyncio.wait_for(self.finished.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return False
        return True

    def when_restored(self, fn: Callable[[], None]) -> None:
        """Run `fn` once every page is indexed (now if it is)."""
        if self.done:
            fn()
        else:
            self._then.append(fn)

    async def run(self) -> None:
        mover, restored = self.mover, 0
        try:
            await self.chained
        except Exception:
            log.exception("disk tier: checking the records failed; the pages on disk are not indexed")
            self._end(0, [])
            return
        unknown = [g for g in self.opened.salts if g.namespace is None]
        for group, ns in self.states:
            orphans = list(group.malformed)
            if group.chained is None:  # the index's C is not built: the records in Python, at once
                restored += ns.index.restore_packed(group.records, orphans)
            else:
                end = time.perf_counter() + SLICE_S
                before = restored
                for hung in hang_steps(ns.index, group.chained, orphans):
                    self.hung_pages = restored = before + hung
                    if time.perf_counter() >= end:
                        await asyncio.sleep(0)  # what waits on the loop runs now
                        end = time.perf_counter() + SLICE_S
            ns.restoring = False
            _drop(mover, orphans, "whose prefix is gone", "orphans_dropped")
        self._end(restored, unknown)

    def _end(self, restored: int, unknown: list[SaltRecords]) -> None:
        for _, ns in self.states:
            ns.restoring = False
        _finish(self.mover, self.opened, unknown, restored)
        self.done = True
        self.finished.set()
        log.info("disk tier: %d pages indexed %.2fs after the daemon answered (records checked %.2fs)", restored,
                 time.monotonic() - self.started, self.opened.chain_s)
        for fn in self._then:
            try:
                fn()
            except Exception:
                log.exception("disk tier: a step after the restore failed")
        self._then.clear()
        # what was read and chained: hundreds of MiB at a million pages, not kept
        self.opened.salts.clear()
        self.opened.scan = None
        self.states.clear()
        self.chained = None


def _finish(mover: DiskMover, opened: OpenedDisk, unknown: list[SaltRecords], restored: int) -> None:
    """After the namespaces' pages: the hybrid models' state checkpoints (they hang on
    restored nodes), and the pages of unknown namespaces dropped."""
    hybrid = mover.service.hybrid
    for group in unknown:
        if hybrid is not None and hybrid.restore_disk(group.salt, opened.scan.tuples(group.rows), mover.tier):
            continue
        keys = opened.scan.key_list(group.rows)
        _drop(mover, keys, f"of an unknown namespace {group.salt.hex()[:16]}", "unknown_ns_pages_dropped")
    mover.rebuilt["restored_pages"] += restored


def _drop(mover: DiskMover, keys: list[bytes], why: str, counter: str) -> None:
    if keys:
        log.warning("dropping %d disk pages %s", len(keys), why)
        mover.rebuilt[counter] += len(keys)
        mover.tier.delete_async(keys)
