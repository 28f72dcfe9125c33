"""RemotePublisher: offers the remote store the pages this daemon holds only on disk.

Write-through (hicache/daemon/movers/remote_mover.py) sends a page to the store when it
becomes host-resident from an engine's backup. Pages that never pass that way stay
unshared: those restored from disk after a restart, and those whose remote write was
dropped (the queue full, the store down past the hold) and that were demoted to disk
since. Each time the store comes up — at start, and after every outage — this task
walks the disk-only nodes of every namespace (parents before children) and, in
batches of PUBLISH_BATCH pages, asks the store which it lacks (one EXISTS round trip),
reads those from disk (the node DISK-locked meanwhile) and writes their records
through the mover's own write path (same records, signing, breaker and hold).

Once the store is full, only nodes the admission expects back are offered
(remote_admission.py). Bounded: at most `remote_publish_pages` pages are probed per
sweep (0: off), the writes share `remote_queue_pages` with write-through (a batch
waits for room, never drops it), and a sweep stops when the store goes down. Hybrid
namespaces are skipped, as everywhere in the remote tier. Runs on the daemon's loop;
the disk reads and the store calls run on their own threads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from hicache.daemon.core.service import CacheService, NamespaceState, path_with_offsets
from hicache.index.radix import Tier, TreeNode
from hicache.tiers.remote.store import addresses

log = logging.getLogger(__name__)

PUBLISH_BATCH = 64  # pages per probe and per write
CHECK_S = 0.5  # how often the task looks whether the store came up


class RemotePublisher:
    def __init__(self, mover: Any, service: CacheService, disk_tier: Any, budget_pages: int,
                 queue_pages: int) -> None:
        self.mover = mover  # RemoteMover: its worker, exists() and publish()
        self.service = service
        self.disk = disk_tier
        self.budget_pages = budget_pages
        self.queue_pages = queue_pages
        self.sweeps = 0
        self.sweeps_done = 0  # passes that ended (done, out of budget, or the store went down)
        self.probed_pages = 0
        self.present_pages = 0  # the store had them already
        self.published_pages = 0
        self.disk_misses = 0  # pages the index had on disk that the disk did not return
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.budget_pages > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        was_up = False
        while True:
            up = self.mover.worker.available
            if up and not was_up:
                try:
                    await self.sweep()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a sweep is best effort; the next outage-and-return retries
                    log.exception("remote tier: publishing disk pages failed")
            was_up = up and self.mover.worker.available
            await asyncio.sleep(CHECK_S)

    async def sweep(self) -> None:
        """One pass over the disk-only pages, up to the budget."""
        self.sweeps += 1
        budget, before = self.budget_pages, self.published_pages
        for ns in list(self.service.namespaces.values()):
            if ns.namespace.state is not None:  # hybrid: checkpoints stay local (docs/remote.md)
                continue
            for node in ns.index.iter_nodes():
                if budget <= 0 or not self.mover.worker.available:
                    break
                if node.removed or not node.on_disk or node.host is not None:
                    continue
                if not self.mover.admission.admit(node):  # a full store takes what is expected back
                    continue
                budget -= await self._publish_node(ns, node, budget)
        self.sweeps_done += 1
        if self.published_pages > before:
            log.info("remote tier: published %d disk pages the store lacked", self.published_pages - before)

    async def _publish_node(self, ns: NamespaceState, node: TreeNode, budget: int) -> int:
        """Probe and publish up to `budget` pages of `node`; returns how many were probed."""
        chain = path_with_offsets(node)
        path_keys = [k for x, _ in chain for k in x.keys]
        pos, n = chain[-1][1], min(node.n_pages, budget)
        probed = 0
        for lo in range(0, n, PUBLISH_BATCH):
            hi = min(n, lo + PUBLISH_BATCH)
            addrs = addresses(ns.salt, path_keys, pos + lo, pos + hi)
            try:
                found = await asyncio.wrap_future(self.mover.exists(addrs))
            except Exception:  # counted by the breaker: the sweep stops with the store
                return probed or n
            probed += hi - lo
            self.probed_pages += hi - lo
            missing = [i for i, there in enumerate(found) if not there]
            self.present_pages += len(found) - len(missing)
            if missing and not await self._write(ns, node, path_keys, pos, lo, addrs, missing):
                return probed or n
        return probed

    async def _write(self, ns: NamespaceState, node: TreeNode, path_keys: list[bytes], pos: int, lo: int,
                     addrs: list, missing: list[int]) -> bool:
        """Read the `missing` pages of addrs (node's pages from lo on; the node starts at
        position pos) from disk and write their records; False when the store failed."""
        while self.mover.queued_pages + len(missing) > self.queue_pages:  # share the queue, never drop
            if not self.mover.worker.available:
                return False
            await asyncio.sleep(0.05)
        if node.removed or not node.on_disk:
            return True
        page_bytes, ps = ns.page_class.page_bytes, ns.index.page_size
        bufs = np.empty((len(missing), page_bytes), dtype=np.uint8)
        ns.index.lock(node, Tier.DISK)  # no disk eviction under the read
        try:
            hits = await asyncio.wrap_future(self.disk.get_many_async(
                ns.salt, [addrs[i].key for i in missing], [memoryview(b) for b in bufs]))
        finally:
            ns.index.unlock(node, Tier.DISK)
        if node.removed or node.n_pages <= lo + missing[-1]:  # evicted, or split, meanwhile
            return True
        pages = []
        for j, i in enumerate(missing):
            if not hits[j]:
                self.disk_misses += 1
                continue
            at = lo + i  # the page's place in the node
            p = pos + at
            pages.append((addrs[i], path_keys[p - 1] if p else None, node.tokens[at * ps:(at + 1) * ps],
                          memoryview(bufs[j])))
        if not pages:
            return True
        try:
            stored, _, _ = await asyncio.wrap_future(self.mover.publish(ns, pages))
        except Exception:
            return False
        self.published_pages += stored
        return True

    def stats(self) -> dict[str, Any]:
        return {"publish_sweeps": self.sweeps, "publish_sweeps_done": self.sweeps_done,
                "publish_probed_pages": self.probed_pages, "publish_present_pages": self.present_pages,
                "published_pages": self.published_pages,
                "publish_disk_misses": self.disk_misses, "publish_budget_pages": self.budget_pages}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

