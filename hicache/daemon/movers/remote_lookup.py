"""RemoteLookups: the remote part of a match — probe, fetch, hand over — on the daemon's loop.

hicache keeps no record of what the remote store holds (anything may be evicted or
lost there at any moment), so a match whose local prefix (device, host, disk) stops
short of the request asks the store for the continuation:

- `start` (from `match`) sends the probe and returns at once: `match` never waits
  for the store. It answers the local part, with `pending` while the probe runs. The
  probe is one pipelined round trip of EXISTS of the pages at offsets 0, 1, 3, 7, ...
  and the last one (galloping: O(log n) commands for n pages; the fetch is the exact
  check), bounded only by the store's op timeout (`remote_timeout_s`); a failure feeds
  the worker's circuit breaker. There is no deadline of its own: an answer that comes
  late is still applied (a fixed 5 ms one threw remote hits away on a loaded host:
  39 to 60 of 60 pages, run to run).
- When the probe finds pages it reserves host pages and starts their fetch at once;
  the found pages join the pin's `disk_len` then, and the engine's client, which asks
  again (`load`), sees them as it sees the disk part. Each record is verified while it
  is copied into its slot; verified pages join the index as host pages under the
  matched prefix (so the next lookup hits host, and the disk tier writes them
  through), and `load` hands them to the engine behind the disk part.
- `load` (hicache/daemon/serve/handlers.py) waits for a running probe (`wait_probe`:
  a lookup, not a transfer — its answer says what there is to load), then for the
  fetch per its `until` (`wait_fetch`), and folds what arrived (`take_fetched`).
- A probe that ends after its engine moved on (released the pin, or loaded it) starts
  no fetch: the engine computed those pages (counted as `unclaimed_pages`).

Bounds. At most MAX_PROBES_IN_FLIGHT probes run at once: each holds a connection of
the store's client, and a store that is that far behind would only queue another;
past it a match is a local miss (`probe_skipped_busy`). While the breaker is open
lookups skip the store at no cost (`probe_skipped_down`). A continuation the store
lacks is remembered for `remote_negative_ttl_s` (the negative cache): a prompt that
misses is probed once, not at every lookup. Pages the engine computes faster than the
store delivers them are not fetched (hicache/daemon/core/fetch_or_recompute.py, fed
with the fetches' timings), and a match whose disk part was left to be recomputed
does not probe at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.config import Config
from hicache.daemon.core.service import CacheService, NamespaceState, Pin
from hicache.index.radix import Tier, TreeNode
from hicache.tiers.remote import record as remote_record
from hicache.tiers.remote.auth import RecordAuth
from hicache.tiers.remote.store import PageAddress, RemoteStore, address, addresses
from hicache.tiers.remote.worker import RemoteWorker

log = logging.getLogger(__name__)

NEGATIVE_CACHE_ENTRIES = 65536
MAX_FETCH_PAGES = 4096  # per lookup: a bound on the host pages one match may reserve
MAX_PROBES_IN_FLIGHT = 32  # concurrent probes; each holds one of the store client's connections


@dataclass(slots=True, eq=False)
class RemoteLookup:
    """The remote part of one match (pin.remote): the probe for the pages after the local
    prefix, then their fetch into reserved host pages."""

    start: int  # position of the first page probed in the request
    keys: Any  # the request's keys up to the last page probed (a PackedKeys slice)
    offsets: list[int]  # probed, relative to start
    probed: asyncio.Future  # resolved once the probe's answer is applied (a fetch started)
    started: float = field(default_factory=time.monotonic)
    n_pages: int = 0  # pages the probe found, being fetched (counted in pin.disk_len)
    host_pages: np.ndarray | None = None  # reserved slots, one per page found
    reservation: Any = None  # of the ingest protocol: committed (or aborted) when the fetch is done
    fetch: asyncio.Future | None = None
    fetch_started: float = 0.0
    done: bool = False  # the fetch ended
    loaded_pages: int = 0  # verified pages in the index, HOST-locked by the pin, not yet folded
    slots: np.ndarray | None = None  # their host slots
    last_node: TreeNode | None = None

    @property
    def probing(self) -> bool:
        return not self.probed.done()


@dataclass(slots=True)
class LookupCounters:
    probes: int = 0
    probes_failed: int = 0  # an error or the op timeout (the breaker counted it): a miss
    probe_waits: int = 0  # loads that waited for a probe still running
    probe_skipped_down: int = 0  # the breaker was open
    probe_skipped_busy: int = 0  # MAX_PROBES_IN_FLIGHT were running
    negative_hits: int = 0
    hit_pages: int = 0  # verified pages brought to host
    miss_pages: int = 0  # continuation pages the store did not have
    unclaimed_pages: int = 0  # found after the engine moved on: not fetched
    fetch_missing: int = 0  # pages a probe promised that the fetch did not find
    corrupt_records: int = 0
    bytes_read: int = 0
    corrupt_reasons: dict[str, int] = field(default_factory=dict)


class RemoteLookups:
    def __init__(self, config: Config, service: CacheService, store: RemoteStore, worker: RemoteWorker,
                 loop: asyncio.AbstractEventLoop, auth: RecordAuth | None,
                 latency: Callable[[str, float], None],
                 write_through: Callable[[NamespaceState, list[TreeNode]], None] | None) -> None:
        self.config = config
        self.service = service
        self.store = store
        self.worker = worker
        self.loop = loop
        self.auth = auth
        self._latency = latency
        self._write_through = write_through  # fetched pages go on to the local disk, not back to the store
        self.counters = LookupCounters()
        self.in_flight = 0  # probes sent and not answered
        self._negative: OrderedDict[bytes, float] = OrderedDict()

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

    def forget_missing(self, key: bytes) -> None:
        """The page is being written (ours now): the next lookup may probe it."""
        self._negative.pop(key, None)

    # -- the probe ---------------------------------------------------------------------
    def start(self, pin: Pin, keys: Any) -> bool:
        """Probe the store for the continuation of pin's local prefix, in the background.
        True: a probe runs for the pin (the match's reply says `pending`)."""
        ns = pin.engine.ns
        start = pin.device_len + pin.host_len + pin.disk_len
        n = min(len(keys) - start, MAX_FETCH_PAGES)
        if n <= 0 or ns.namespace.state is not None:  # hybrid models keep their checkpoints local
            return False
        c = self.counters
        if not self.worker.available:
            c.probe_skipped_down += 1
            return False
        if self._negative_hit(keys[start]):
            c.negative_hits += 1
            return False
        if self.in_flight >= MAX_PROBES_IN_FLIGHT:
            c.probe_skipped_busy += 1
            return False
        all_keys = keys[0:start + n]  # a PackedKeys slice: a list of bytes
        offsets = sorted({(1 << j) - 1 for j in range(n.bit_length()) if (1 << j) - 1 < n} | {n - 1})
        lookup = RemoteLookup(start, all_keys, offsets, self.loop.create_future())
        pin.remote = lookup
        self.in_flight += 1
        c.probes += 1
        fut = self.worker.submit(self.exists([address(ns.salt, all_keys, start + o) for o in offsets]))
        fut.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._probed, pin, lookup, f))
        return True

    async def exists(self, pages: list[PageAddress]) -> list[bool]:
        """On the worker: EXISTS, bounded by the op timeout; a failure counts for the breaker."""
        try:
            found = await asyncio.wait_for(self.store.exists(pages), self.config.remote_timeout_s)
        except Exception as e:
            self.worker.failure(e)
            raise
        self.worker.success()
        return found

    def _probed(self, pin: Pin, lookup: RemoteLookup, fut: concurrent.futures.Future) -> None:
        self.in_flight -= 1
        try:
            self._apply_probe(pin, lookup, fut)
        finally:
            lookup.probed.set_result(None)

    def _apply_probe(self, pin: Pin, lookup: RemoteLookup, fut: concurrent.futures.Future) -> None:
        c = self.counters
        if fut.cancelled() or fut.exception() is not None:  # the worker counted the failure
            c.probes_failed += 1
            return
        self._latency("probe", lookup.started)
        start, n = lookup.start, len(lookup.keys) - lookup.start
        remote_len = 0
        for o, there in zip(lookup.offsets, fut.result()):
            if not there:
                break
            remote_len = o + 1
        c.miss_pages += n - remote_len
        if remote_len < n:
            self._remember_missing(lookup.keys[start + remote_len])
        if remote_len == 0:
            return
        ns = pin.engine.ns
        if pin.pin_id not in self.service.pins or pin.loaded or ns is not self.service.namespaces.get(ns.salt):
            c.unclaimed_pages += remote_len  # the engine moved on: it computed these
            return
        if not self.service.worth_loading("remote", pin.engine, start, remote_len):
            pin.recompute_from = start  # cheaper to compute (fetch_or_recompute.py)
            return
        reserved = self.service.ingest.reserve("fetch", ns, remote_len, engine=None)  # the daemon's own
        if reserved is None:
            return
        lookup.n_pages, lookup.host_pages, lookup.reservation = remote_len, reserved.host_pages, reserved
        pin.disk_len += remote_len
        arena, page_bytes = self.service.host.arena.array, ns.page_class.page_bytes
        outs = [arena[int(s) * page_bytes:(int(s) + 1) * page_bytes] for s in reserved.host_pages]
        parent = lookup.keys[start - 1] if start else None
        lookup.fetch_started = time.monotonic()
        job = self.worker.submit(self._fetch(ns, addresses(ns.salt, lookup.keys, start, start + remote_len),
                                             parent, outs))
        lookup.fetch = asyncio.wrap_future(job, loop=self.loop)
        lookup.fetch.add_done_callback(lambda f: self._fetched(pin, lookup, f))

    # -- the fetch -----------------------------------------------------------------------
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

    def _fetched(self, pin: Pin, lookup: RemoteLookup, fut: asyncio.Future) -> None:
        lookup.done = True
        ns = pin.engine.ns
        self._latency("fetch", lookup.fetch_started)
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
            self.service.fetch_cost.observe("remote", nbytes, time.monotonic() - lookup.fetch_started)
        start, end = lookup.start, lookup.start + lookup.n_pages
        if n_ok < lookup.n_pages:
            c.fetch_missing += lookup.n_pages - n_ok - sum(corrupt.values())
            self._remember_missing(lookup.keys[start + n_ok])
        index = ns.index
        parent = index.root if start == 0 else index.node_ending_at(lookup.keys[:start])
        reserved = lookup.reservation
        if n_ok == 0 or parent is None or ns is not self.service.namespaces.get(ns.salt):
            self.service.ingest.abort(reserved)
            return
        c.hit_pages += n_ok
        keys, host_pages = lookup.keys[start:end], lookup.host_pages

        def place(_: object) -> tuple[list[TreeNode], list[np.ndarray]]:
            res = index.extend_host(parent, keys[:n_ok], tokens, host_pages[:n_ok])
            if pin.pin_id in self.service.pins and not pin.loaded and res.nodes:
                last = res.nodes[-1]
                index.lock(last, Tier.HOST)
                pin.locks.append((last, Tier.HOST, None))
                lookup.slots = np.concatenate([node.host for node in res.nodes])
                lookup.loaded_pages, lookup.last_node = n_ok, last
            return res.new_nodes, [host_pages[n_ok:], res.dup_host_pages]

        self.service.ingest.commit(reserved, place, write_through=self._write_through)

    # -- load ---------------------------------------------------------------------------
    async def wait_probe(self, pin: Pin) -> None:
        """Until the pin's probe (if one runs) has answered and its answer is applied; the
        probe's own op timeout bounds the wait."""
        lookup = pin.remote
        if lookup is None or not lookup.probing:
            return
        self.counters.probe_waits += 1
        await asyncio.wait([lookup.probed])  # not cancelled with the waiter: the probe is shared

    def pending(self, pin: Pin) -> bool:
        """Whether the pin's probe still runs (its answer may add pages)."""
        return pin.remote is not None and pin.remote.probing

    async def wait_fetch(self, pin: Pin, policy: str, timeout_s: float) -> None:
        lookup = pin.remote
        if lookup is None or lookup.done or lookup.fetch is None:
            return
        if policy == "wait_complete":
            await asyncio.wait([lookup.fetch])
        elif policy == "timeout":
            await asyncio.wait([lookup.fetch], timeout=timeout_s)
        if not lookup.done:  # the callback runs on the loop turn after the future resolves
            await asyncio.sleep(0)

    def take_fetched(self, pin: Pin) -> None:
        """Fold the verified remote pages into the pin's host part, if everything before
        them (the local disk part) is on host too."""
        lookup = pin.remote
        if lookup is None or not lookup.done or not lookup.loaded_pages or pin.loaded or lookup.slots is None:
            return
        if pin.disk_len != lookup.n_pages:  # the local disk part did not all arrive
            return
        pin.host_pages = np.concatenate([pin.host_pages, lookup.slots])
        pin.host_len += lookup.loaded_pages
        pin.disk_len -= lookup.loaded_pages
        pin.host_node = lookup.last_node
        lookup.loaded_pages = 0

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"probes": c.probes, "probes_in_flight": self.in_flight, "max_probes_in_flight": MAX_PROBES_IN_FLIGHT,
                "probes_failed": c.probes_failed, "probe_waits": c.probe_waits,
                "probe_skipped_down": c.probe_skipped_down, "probe_skipped_busy": c.probe_skipped_busy,
                "negative_hits": c.negative_hits, "hit_pages": c.hit_pages, "miss_pages": c.miss_pages,
                "unclaimed_pages": c.unclaimed_pages, "fetch_missing": c.fetch_missing,
                "corrupt_records": c.corrupt_records, "corrupt_reasons": dict(c.corrupt_reasons),
                "bytes_read": c.bytes_read}


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
