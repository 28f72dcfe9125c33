"""RemoteMover: the remote tier (L4) behind the disk tier, on the daemon's event loop.

The remote store (hicache/tiers/remote/store.py, Redis by default) is shared by
daemons on many machines: a prefix one of them computed is a hit for the others.
hicache keeps no record of what the store holds — anything may be evicted or lost
there at any moment — so the store is asked, not remembered:

- Lookups (hicache/daemon/movers/remote_lookup.py). A `match` whose local prefix
  stops short of the request probes the store for the continuation in the
  background and answers at once, with `pending` while the probe runs; the probe
  has no deadline of its own, only the store's op timeout. The pages it finds are
  fetched into host at once and join the match's `disk_len`; the engine's client
  asks again (`load`, whose `until` says how long to wait) and gets them as it gets
  the disk part.
- Writes. Pages that become host-resident from an engine's backup are written
  through asynchronously (once the store is full, only those the admission
  expects back: remote_admission.py): their host nodes are locked only until their records
  are built (a copy with the checksum, on the worker's CPU pool), then sent as
  one pipeline per batch with `remote_ttl_s`. At most `remote_queue_pages` pages
  are in flight; beyond that writes are dropped and counted. A write that meets
  an open breaker, or fails, waits for the store and tries again for up to
  `remote_write_hold_s`, then is dropped (counted): a store that was out for a
  moment loses nothing.
- Faults. Every operation is bounded by the op timeout (`remote_timeout_s`); an
  error or an overrun is a failure for the worker's circuit breaker
  (hicache/tiers/remote/worker.py, rule in remote/breaker.py), and the lookup it
  belonged to a miss. While the breaker is open lookups skip the store at no cost
  and writes wait (as above), until a background PING succeeds.
- Authentication. With `remote_secret_file`, records are signed and every record
  read must carry a MAC under one of its secrets (hicache/tiers/remote/auth.py);
  without it records are unsigned and the store is trusted, said once at start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.config import Config
from hicache.daemon.core.service import CacheService, NamespaceState, path_with_offsets
from hicache.daemon.movers.remote_admission import RemoteAdmission
from hicache.daemon.movers.remote_lookup import RemoteLookups
from hicache.index.radix import Tier, TreeNode
from hicache.tiers.remote import record as remote_record
from hicache.tiers.remote.auth import RecordAuth
from hicache.tiers.remote.store import PageAddress, PartialWrite, RemoteStore, addresses
from hicache.tiers.remote.worker import BACKOFF_S, RemoteWorker, is_full_store

log = logging.getLogger(__name__)

MAX_LATENCIES = 10000
FLUSH_TIMEOUT_S = 30.0  # an admin flush scans every master


@dataclass(slots=True, eq=False)
class _PutJob:
    ns: NamespaceState
    nodes: list[TreeNode]  # HOST-locked until the records are built
    pages: list[tuple[PageAddress, bytes | None, np.ndarray, memoryview]]  # address, parent, tokens, slot view
    locked: bool = True
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class RemoteCounters:
    """The writes' counters (the lookups' are remote_lookup.LookupCounters)."""

    written_pages: int = 0
    dropped_pages: int = 0  # write-through skipped: queue full, or the store down past the hold
    failed_writes: int = 0  # pages of writes that failed past the hold
    write_retries: int = 0  # sends of a write after a failure or an open breaker
    bytes_written: int = 0


class RemoteMover:
    def __init__(self, config: Config, service: CacheService, store: RemoteStore,
                 loop: asyncio.AbstractEventLoop, auth: RecordAuth | None = None) -> None:
        self.config = config
        self.service = service
        self.store = store
        self.loop = loop
        self.auth = auth
        self.worker = RemoteWorker(store, timeout_s=config.remote_timeout_s)
        self.counters = RemoteCounters()
        self.queued_pages = 0
        self._latencies: list[tuple[str, float]] = []
        self._buffers = remote_record.BufferPool()
        self.publisher: Any = None  # RemotePublisher, with a disk tier
        # Which pages are written (remote_admission.py): all while the store has room.
        self.admission = RemoteAdmission(config.remote_admission, self, service.admission)
        # Chain behind the disk tier's write-through: both hear of new host pages, and
        # pages fetched from the store go on to the disk tier through the saved hook only.
        self._disk_hook = service.on_host_stored
        service.on_host_stored = self._host_stored
        self.lookups = RemoteLookups(config, service, store, self.worker, loop, auth, self._latency,
                                     self._disk_hook)

    @classmethod
    def start(cls, config: Config, service: CacheService, store: RemoteStore,
              auth: RecordAuth | None = None) -> RemoteMover:
        """A store that is down is not an error: the breaker starts open and closes when it
        answers."""
        mover = cls(config, service, store, asyncio.get_running_loop(), auth)
        log.info("remote tier: %s, operations bounded by %.0f ms, ttl %s", store.describe()["url"],
                 config.remote_timeout_s * 1000,
                 f"{config.remote_ttl_s:g}s" if config.remote_ttl_s > 0 else "none")
        if auth is None:
            log.warning("remote tier: records are NOT authenticated (no remote_secret_file): anyone who can "
                        "write to %s can make this daemon serve KV of their choosing", store.describe()["url"])
        else:
            log.info("remote tier: records signed and verified (%s)", auth.describe())
        return mover

    def _latency(self, op: str, started: float) -> None:
        if len(self._latencies) < MAX_LATENCIES:
            self._latencies.append((op, time.monotonic() - started))

    def take_latencies(self) -> list[tuple[str, float]]:
        out, self._latencies = self._latencies, []
        return out

    def _post(self, fut: concurrent.futures.Future, fn: Any, *args: Any) -> None:
        """When the worker's future resolves, run fn(*args, fut) on the daemon's loop."""
        fut.add_done_callback(lambda f: self.loop.call_soon_threadsafe(fn, *args, f))

    # -- writes -----------------------------------------------------------------------
    def _host_stored(self, ns: NamespaceState, nodes: list[TreeNode]) -> None:
        if self._disk_hook is not None:
            self._disk_hook(ns, nodes)
        if ns.namespace.state is None:
            self.write_through(ns, nodes)

    def write_through(self, ns: NamespaceState, nodes: list[TreeNode]) -> None:
        todo = [n for n in nodes if n.host is not None and not n.removed and self.admission.admit(n)]
        n_pages = sum(n.n_pages for n in todo)
        if not n_pages:
            return
        # A short outage is waited out (_put); a store down for longer than the hold is
        # not worth building records for.
        if (self.queued_pages + n_pages > self.config.remote_queue_pages
                or self.worker.down_for() > self.config.remote_write_hold_s):
            self.counters.dropped_pages += n_pages
            return
        arena, page_bytes, ps = self.service.host.arena.array, ns.page_class.page_bytes, ns.index.page_size
        pages = []
        for node in todo:
            chain = path_with_offsets(node)
            path_keys = [k for x, _ in chain for k in x.keys]
            pos = chain[-1][1]
            for i, addr in enumerate(addresses(ns.salt, path_keys, pos, pos + node.n_pages)):
                p = pos + i
                slot = int(node.host[i])
                pages.append((addr, path_keys[p - 1] if p else None, node.tokens[i * ps:(i + 1) * ps],
                              memoryview(arena[slot * page_bytes:(slot + 1) * page_bytes])))
                self.lookups.forget_missing(addr.key)  # ours now: the next lookup may probe it
            ns.index.lock(node, Tier.HOST)  # the slots stay put until the records are built
        job = _PutJob(ns, todo, pages)
        self.queued_pages += n_pages
        self._post(self.worker.submit(self._put(job)), self._put_done, job)

    async def _put(self, job: _PutJob) -> tuple[int, int, int]:
        """On the worker: build the records (the host locks go as soon as they are), send them,
        waiting out an open breaker and retrying a failed send for up to remote_write_hold_s
        (SET is idempotent). Returns (pages stored, bytes sent, pages dropped)."""
        try:
            fp = job.ns.namespace.layout.fingerprint()
            records = await self.worker.run_cpu(_encode, job.ns.salt, fp, job.pages, self._buffers, self.auth)
        finally:
            self.loop.call_soon_threadsafe(self._unlock, job)
        nbytes = sum(len(r) for _, r in records)
        hold_until = time.monotonic() + self.config.remote_write_hold_s
        tries = 0
        while True:
            if not await self.worker.wait_up(hold_until - time.monotonic()):
                return 0, 0, len(records)  # the store stayed away past the hold
            tries += 1
            try:
                stored = await asyncio.wait_for(self.store.put(records, self.config.remote_ttl_s),
                                                self.config.remote_timeout_s)
            except PartialWrite as e:
                self.worker.failure(e.cause)
                error: BaseException = e
            except Exception as e:
                self.worker.failure(e)
                error = e
            else:
                self.worker.success()
                self.loop.call_soon_threadsafe(self._count_retries, tries - 1)
                # only after a clean send: a cancelled pipeline may still hold views of them
                self._buffers.give([r for _, r in records])
                return stored, nbytes, 0
            cause = error.cause if isinstance(error, PartialWrite) else error
            if is_full_store(cause) or time.monotonic() >= hold_until:
                self.loop.call_soon_threadsafe(self._count_retries, tries - 1)
                if isinstance(error, PartialWrite):
                    return error.stored, nbytes * error.stored // max(1, len(records)), 0
                raise error
            await asyncio.sleep(BACKOFF_S[0])

    def exists(self, pages: list[PageAddress]) -> concurrent.futures.Future:  # for remote_publish.py
        return self.worker.submit(self.lookups.exists(pages))

    def publish(self, ns: NamespaceState, pages: list) -> concurrent.futures.Future:
        """Write pages held outside the arena (remote_publish.py), given as write_through
        builds them; their buffers must outlive the future (result: stored, bytes, dropped)."""
        job = _PutJob(ns, [], pages, locked=False)
        self.queued_pages += len(pages)
        self._post(fut := self.worker.submit(self._put(job)), self._put_done, job)
        return fut

    def _count_retries(self, n: int) -> None:
        self.counters.write_retries += n

    def _unlock(self, job: _PutJob) -> None:
        if not job.locked:
            return
        job.locked = False
        for node in job.nodes:
            job.ns.index.unlock(node, Tier.HOST)
        self.service.reap(job.ns)

    def _put_done(self, job: _PutJob, fut: concurrent.futures.Future) -> None:
        self._unlock(job)  # a job cancelled before it ran
        self.queued_pages -= len(job.pages)
        self._latency("put", job.started)
        try:
            stored, nbytes, dropped = fut.result()
        except BaseException:
            self.counters.failed_writes += len(job.pages)
            return
        self.counters.written_pages += stored
        self.counters.dropped_pages += dropped
        self.counters.failed_writes += len(job.pages) - stored - dropped
        self.counters.bytes_written += nbytes

    # -- admin and lifecycle ------------------------------------------------------------------
    async def flush_namespace(self, salt: bytes) -> int:
        """Delete a namespace's records from the store (admin); raises when it is down."""
        fut = self.worker.submit(self.store.delete_namespace(salt))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), FLUSH_TIMEOUT_S)
        finally:
            fut.cancel()

    def stats(self) -> dict[str, Any]:
        c, w = self.counters, self.worker
        published = self.publisher.stats() if self.publisher is not None else {}
        return {**self.store.describe(), **published, **self.admission.stats(), "state": w.state,
                "available": w.available,
                "last_error": w.last_error,
                "auth": self.auth.describe() if self.auth is not None else "none (unauthenticated records)",
                "errors": w.errors, "breaker_opens": w.breaker_opens,
                "consecutive_failures": w.breaker.consecutive, "queue_pages": self.queued_pages,
                "max_queue_pages": self.config.remote_queue_pages, "write_retries": c.write_retries,
                **self.lookups.stats(),
                "written_pages": c.written_pages, "dropped_pages": c.dropped_pages,
                "failed_writes": c.failed_writes, "bytes_written": c.bytes_written,
                "ttl_s": self.config.remote_ttl_s, "timeout_s": self.config.remote_timeout_s}

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.worker.close()


def _encode(salt: bytes, fingerprint: bytes, pages: list, pool: remote_record.BufferPool,
            auth: RecordAuth | None) -> list[tuple[PageAddress, memoryview]]:
    return [(addr, remote_record.encode(salt, addr.key, parent, fingerprint, tokens, view, pool=pool, auth=auth))
            for addr, parent, tokens, view in pages]
