"""RemoteMover: the remote tier (L4) behind the disk tier, on the daemon's event loop.

The remote store (hicache/tiers/remote_store.py, Redis by default) is shared by
daemons on many machines: a prefix one of them computed is a hit for the others.
hicache keeps no record of what the store holds — anything may be evicted or lost
there at any moment — so the store is asked, not remembered:

- Lookups. A `match` whose local prefix (device, host, disk) stops short of the
  request probes the store for the continuation in one pipelined round trip,
  bounded by `remote_lookup_timeout_s`: EXISTS of the pages at offsets 0, 1, 3, 7,
  ... and the last one (a galloping probe: O(log n) commands for n pages; the
  fetch is the exact check). The pages found are reported as part of the match's
  `disk_len` — the engine's client then calls `load`, as for the disk part — and
  fetched at once into freshly allocated host pages. Each record is verified
  (hicache/tiers/remote_record.py) while it is copied into its slot; verified
  pages join the index as host pages under the matched prefix (so the next
  lookup hits host, and the disk tier writes them through), and `load` hands
  them to the engine under the load policy (best_effort / wait_complete /
  timeout), behind the disk part. A continuation the store lacks is remembered
  for `remote_negative_ttl_s` (a negative cache): a prompt that misses is probed
  once, not at every lookup. Pages the engine computes faster than the store
  delivers them are not fetched (hicache/daemon/core/fetch_or_recompute.py, fed
  with the fetches' timings), and a match whose disk part was left to be
  recomputed does not probe at all.
- Writes. Pages that become host-resident from an engine's backup are written
  through asynchronously (once the store is full, only those the admission
  expects back: remote_admission.py): their host nodes are locked only until their records
  are built (a copy with the checksum, on the worker's CPU pool), then sent as
  one pipeline per batch with `remote_ttl_s`. At most `remote_queue_pages` pages
  are in flight; beyond that writes are dropped and counted. A write that meets
  an open breaker, or fails, waits for the store and tries again for up to
  `remote_write_hold_s`, then is dropped (counted): a store that was out for a
  moment loses nothing.
- Faults cost each lookup at most its deadline, then nothing. A probe that
  overruns the lookup's deadline is left to finish (bounded by the op timeout):
  until it does, lookups skip the store, so a hung store costs one lookup its
  deadline; a probe that answers late is a slow store, not a failure. Failures
  (an error, or the op timeout) feed the worker's circuit breaker
  (hicache/tiers/remote_worker.py, rule in remote_breaker.py); while it is open
  lookups skip the store until a background PING succeeds.
- Authentication. With `remote_secret_file`, records are signed and every record
  read must carry a MAC under one of its secrets (hicache/tiers/remote_auth.py);
  without it records are unsigned and the store is trusted, said once at start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.config import Config
from hicache.daemon.core.service import CacheService, NamespaceState, Pin, path_with_offsets
from hicache.daemon.movers.remote_admission import RemoteAdmission
from hicache.index.radix import Tier, TreeNode
from hicache.tiers import remote_record
from hicache.tiers.remote_auth import RecordAuth
from hicache.tiers.remote_store import PageAddress, PartialWrite, RemoteStore, address, addresses
from hicache.tiers.remote_worker import BACKOFF_S, RemoteWorker, is_full_store

log = logging.getLogger(__name__)

NEGATIVE_CACHE_ENTRIES = 65536
MAX_LATENCIES = 10000
FLUSH_TIMEOUT_S = 30.0  # an admin flush scans every master
MAX_FETCH_PAGES = 4096  # per lookup: a bound on the host pages one match may reserve


@dataclass(slots=True, eq=False)
class RemoteFetch:
    """The remote part of one match: pages after the local prefix, being fetched to host."""

    start: int  # position of the first remote page in the request
    prefix_keys: list[bytes]  # the request's keys before it (finds the parent node when done)
    keys: list[bytes]
    host_pages: np.ndarray  # reserved slots, one per page of `keys`
    reservation: Any  # of the ingest protocol: committed (or aborted) when the fetch is done
    future: asyncio.Future | None = None
    done: bool = False
    loaded_pages: int = 0  # verified pages in the index, HOST-locked by the pin, not yet folded
    slots: np.ndarray | None = None  # their host slots
    last_node: TreeNode | None = None
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True, eq=False)
class _PutJob:
    ns: NamespaceState
    nodes: list[TreeNode]  # HOST-locked until the records are built
    pages: list[tuple[PageAddress, bytes | None, np.ndarray, memoryview]]  # address, parent, tokens, slot view
    locked: bool = True
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class RemoteCounters:
    probes: int = 0
    probes_late: int = 0  # overran the lookup's deadline (a miss for that lookup, not a failure)
    probe_skipped_down: int = 0
    probe_skipped_slow: int = 0  # a late probe was still out: the lookup did not wait on the store
    negative_hits: int = 0
    hit_pages: int = 0  # verified pages brought to host
    miss_pages: int = 0  # continuation pages the store did not have
    fetch_missing: int = 0  # pages a probe promised that the fetch did not find
    corrupt_records: int = 0
    written_pages: int = 0
    dropped_pages: int = 0  # write-through skipped: queue full, or the store down past the hold
    failed_writes: int = 0  # pages of writes that failed past the hold
    write_retries: int = 0  # sends of a write after a failure or an open breaker
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_reasons: dict[str, int] = field(default_factory=dict)


class RemoteMover:
    def __init__(self, config: Config, service: CacheService, store: RemoteStore,
                 loop: asyncio.AbstractEventLoop, auth: RecordAuth | None = None) -> None:
        self.config = config
        self.service = service
        self.store = store
        self.loop = loop
        self.auth = auth
        self._late_probe: concurrent.futures.Future | None = None  # a probe past its lookup's deadline
        self.worker = RemoteWorker(store, timeout_s=config.remote_timeout_s)
        self.counters = RemoteCounters()
        self.queued_pages = 0
        self._negative: OrderedDict[bytes, float] = OrderedDict()
        self._latencies: list[tuple[str, float]] = []
        self._buffers = remote_record.BufferPool()
        self.publisher: Any = None  # RemotePublisher, with a disk tier
        # Which pages are written (remote_admission.py): all while the store has room.
        self.admission = RemoteAdmission(config.remote_admission, self, service.admission)
        # Chain behind the disk tier's write-through: both hear of new host pages, and
        # pages fetched from the store go on to the disk tier through the saved hook only.
        self._disk_hook = service.on_host_stored
        service.on_host_stored = self._host_stored

    @classmethod
    def start(cls, config: Config, service: CacheService, store: RemoteStore,
              auth: RecordAuth | None = None) -> RemoteMover:
        """A store that is down is not an error: the breaker starts open and closes when it
        answers."""
        mover = cls(config, service, store, asyncio.get_running_loop(), auth)
        log.info("remote tier: %s, lookups bounded by %.0f ms, ttl %s", store.describe()["url"],
                 config.remote_lookup_timeout_s * 1000,
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

    # -- negative cache ------------------------------------------------------------
    def _negative_hit(self, key: bytes) -> bool:
        until = self._negative.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            del self._negative[key]
            return False
        return True

    def _remember_missing(self, key: bytes) -> None:
        self._negative[key] = time.monotonic() + self.config.remote_negative_ttl_s
        self._negative.move_to_end(key)
        while len(self._negative) > NEGATIVE_CACHE_ENTRIES:
            self._negative.popitem(last=False)

    # -- lookups ---------------------------------------------------------------------
    async def extend_match(self, pin: Pin, keys: Any) -> None:
        """Probe the store for the continuation of pin's local prefix and start fetching
        what it holds; the found pages join pin.disk_len."""
        ns = pin.engine.ns
        start = pin.device_len + pin.host_len + pin.disk_len
        n = min(len(keys) - start, MAX_FETCH_PAGES)
        if n <= 0 or ns.namespace.state is not None:  # hybrid models keep their checkpoints local
            return
        if not self.worker.available:
            self.counters.probe_skipped_down += 1
            return
        if self._late_probe is not None:
            if not self._late_probe.done():  # the store has not answered the last probe yet
                self.counters.probe_skipped_slow += 1
                return
            self._late_probe = None
        if self._negative_hit(keys[start]):
            self.counters.negative_hits += 1
            return
        all_keys = keys[0:start + n]  # a PackedKeys slice: a list of bytes
        offsets = sorted({(1 << j) - 1 for j in range(n.bit_length()) if (1 << j) - 1 < n} | {n - 1})
        probe = [address(ns.salt, all_keys, start + o) for o in offsets]
        self.counters.probes += 1
        t0 = time.monotonic()
        fut = self.worker.submit(self._probe(probe))
        answer = asyncio.wrap_future(fut, loop=self.loop)
        answer.add_done_callback(_retrieve)
        await asyncio.wait([answer], timeout=self.config.remote_lookup_timeout_s)
        if not answer.done():  # a miss for this lookup; not cancelled: a late answer is no failure
            self._late_probe = fut
            self.counters.probes_late += 1
            return
        if answer.cancelled() or answer.exception() is not None:  # the worker counted the failure
            return
        found = answer.result()
        self._latency("probe", t0)
        remote_len = 0
        for o, there in zip(offsets, found):
            if not there:
                break
            remote_len = o + 1
        self.counters.miss_pages += n - remote_len
        if remote_len < n:
            self._remember_missing(all_keys[start + remote_len])
        if remote_len == 0 or pin.pin_id not in self.service.pins or pin.loaded:
            return
        if not self.service.worth_loading("remote", pin.engine, start, remote_len):
            pin.recompute_from = start  # cheaper to compute (fetch_or_recompute.py)
            return
        reserved = self.service.ingest.reserve("fetch", ns, remote_len, engine=None)  # the daemon's own
        if reserved is None:
            return
        host_pages = reserved.host_pages
        rf = RemoteFetch(start, all_keys[:start], all_keys[start:start + remote_len], host_pages, reserved)
        pin.remote = rf
        pin.disk_len += remote_len
        arena, page_bytes = self.service.host.arena.array, ns.page_class.page_bytes
        outs = [arena[int(s) * page_bytes:(int(s) + 1) * page_bytes] for s in host_pages]
        parent = all_keys[start - 1] if start else None
        job = self.worker.submit(self._fetch(ns, addresses(ns.salt, all_keys, start, start + remote_len),
                                             parent, outs))
        rf.future = asyncio.wrap_future(job, loop=self.loop)
        rf.future.add_done_callback(lambda f: self._fetched(pin, rf, f))

    async def _probe(self, pages: list[PageAddress]) -> list[bool]:
        """On the worker: EXISTS, bounded by the op timeout (not the lookup's deadline)."""
        try:
            found = await asyncio.wait_for(self.store.exists(pages), self.config.remote_timeout_s)
        except Exception as e:
            self.worker.failure(e)
            raise
        self.worker.success()
        return found

    async def _fetch(self, ns: NamespaceState, pages: list[PageAddress], parent: bytes | None,
                     outs: list[np.ndarray]) -> tuple[int, np.ndarray, int, dict[str, int]]:
        """On the worker: the records, verified into their slots. Returns (pages verified
        in order, their tokens, bytes read, corrupt records by reason)."""
        layout = ns.namespace.layout
        size = remote_record.record_bytes(layout.page_size, ns.page_class.page_bytes)
        try:
            blobs = await asyncio.wait_for(self.store.get(pages, size), self.config.remote_timeout_s)
        except Exception as e:
            self.worker.failure(e)
            raise
        self.worker.success()
        return await self.worker.run_cpu(_verify, ns.salt, layout.fingerprint(), layout.page_size,
                                         pages, parent, blobs, outs, self.auth)

    def _fetched(self, pin: Pin, rf: RemoteFetch, fut: asyncio.Future) -> None:
        rf.done = True
        ns = pin.engine.ns
        self._latency("fetch", rf.started)
        try:
            n_ok, tokens, nbytes, corrupt = fut.result()
        except Exception:  # counted by the breaker; the pages are a miss
            n_ok, tokens, nbytes, corrupt = 0, np.empty(0, dtype=np.int32), 0, {}
        c = self.counters
        c.bytes_read += nbytes
        for reason, count in corrupt.items():
            c.corrupt_records += count
            c.corrupt_reasons[reason] = c.corrupt_reasons.get(reason, 0) + count
            log.warning("remote tier: %d record(s) refused (%s); served as a miss", count, reason)
        if nbytes and self.service.fetch_cost is not None:  # the store's read speed: fetch or recompute
            self.service.fetch_cost.observe("remote", nbytes, time.monotonic() - rf.started)
        if n_ok < len(rf.keys):
            c.fetch_missing += len(rf.keys) - n_ok - sum(corrupt.values())
            self._remember_missing(rf.keys[n_ok])
        index = ns.index
        parent = index.root if rf.start == 0 else index.node_ending_at(rf.prefix_keys)
        reserved = rf.reservation
        if n_ok == 0 or parent is None or ns is not self.service.namespaces.get(ns.salt):
            self.service.ingest.abort(reserved)
            return
        c.hit_pages += n_ok

        def place(_: object) -> tuple[list[TreeNode], list[np.ndarray]]:
            res = index.extend_host(parent, rf.keys[:n_ok], tokens, rf.host_pages[:n_ok])
            if pin.pin_id in self.service.pins and not pin.loaded and res.nodes:
                last = res.nodes[-1]
                index.lock(last, Tier.HOST)
                pin.locks.append((last, Tier.HOST, None))
                rf.slots = np.concatenate([node.host for node in res.nodes])
                rf.loaded_pages, rf.last_node = n_ok, last
            return res.new_nodes, [rf.host_pages[n_ok:], res.dup_host_pages]

        # written through to the local disk, not back to the store
        self.service.ingest.commit(reserved, place, write_through=self._disk_hook)

    async def wait_fetch(self, pin: Pin, policy: str, timeout_s: float) -> None:
        rf = pin.remote
        if rf is None or rf.done or rf.future is None:
            return
        if policy == "wait_complete":
            await asyncio.wait([rf.future])
        elif policy == "timeout":
            await asyncio.wait([rf.future], timeout=timeout_s)
        if not rf.done:  # the callback runs on the loop turn after the future resolves
            await asyncio.sleep(0)

    def take_fetched(self, pin: Pin) -> None:
        """Fold the verified remote pages into the pin's host part, if everything before
        them (the local disk part) is on host too."""
        rf = pin.remote
        if rf is None or not rf.done or not rf.loaded_pages or pin.loaded or rf.slots is None:
            return
        if pin.disk_len != len(rf.keys):  # the local disk part did not all arrive
            return
        pin.host_pages = np.concatenate([pin.host_pages, rf.slots])
        pin.host_len += rf.loaded_pages
        pin.disk_len -= rf.loaded_pages
        pin.host_node = rf.last_node
        rf.loaded_pages = 0

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
                self._negative.pop(addr.key, None)  # ours now: the next lookup may probe it
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
        return self.worker.submit(self._probe(pages))

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
                "probes": c.probes, "probes_late": c.probes_late, "probe_skipped_down": c.probe_skipped_down,
                "probe_skipped_slow": c.probe_skipped_slow, "negative_hits": c.negative_hits,
                "hit_pages": c.hit_pages, "miss_pages": c.miss_pages, "fetch_missing": c.fetch_missing,
                "corrupt_records": c.corrupt_records, "corrupt_reasons": dict(c.corrupt_reasons),
                "written_pages": c.written_pages, "dropped_pages": c.dropped_pages,
                "failed_writes": c.failed_writes, "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
                "ttl_s": self.config.remote_ttl_s, "lookup_timeout_s": self.config.remote_lookup_timeout_s}

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.worker.close()


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a late probe's outcome as seen (the worker counted any failure)."""
    if not fut.cancelled():
        fut.exception()


def _encode(salt: bytes, fingerprint: bytes, pages: list, pool: remote_record.BufferPool,
            auth: RecordAuth | None) -> list[tuple[PageAddress, memoryview]]:
    return [(addr, remote_record.encode(salt, addr.key, parent, fingerprint, tokens, view, pool=pool, auth=auth))
            for addr, parent, tokens, view in pages]


def _verify(salt: bytes, fingerprint: bytes, page_size: int, pages: list[PageAddress], parent: bytes | None,
            blobs: list[bytes | None], outs: list[np.ndarray], auth: RecordAuth | None
            ) -> tuple[int, np.ndarray, int, dict[str, int]]:
    """Verify records in order into their slots, up to the first missing or bad one."""
    tokens: list[np.ndarray] = []
    nbytes = 0
    corrupt: dict[str, int] = {}
    for page, blob, out in zip(pages, blobs, outs):
        if blob is None:
            break
        nbytes += len(blob)
        try:
            tokens.append(remote_record.decode_into(blob, salt=salt, key=page.key, parent=parent,
                                                    fingerprint=fingerprint, page_size=page_size, out=out,
                                                    auth=auth))
        except remote_record.RecordError as e:
            corrupt[e.reason] = corrupt.get(e.reason, 0) + 1
            break
        parent = page.key
    toks = np.concatenate(tokens) if tokens else np.empty(0, dtype=np.int32)
    return len(tokens), toks, nbytes, corrupt
