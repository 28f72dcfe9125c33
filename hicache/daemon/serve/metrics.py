"""Prometheus metrics of the daemon, and a loopback-only /metrics endpoint.

Everything lives in a private CollectorRegistry (not prometheus-client's
global one), so several daemons in one process, such as tests, never collide.
The daemon calls small methods (`observe_rpc`, `set_tier`, ...) that hold
pre-resolved label children, so a hot-path update is a dict lookup and a
locked add.

Label values are bounded: tiers are the fixed set given at construction, and
RPC method names (which a client chooses) outside the known set are counted as
``other``, so a misbehaving client cannot create unbounded series.

Units follow Prometheus conventions: seconds and bytes; hits, misses and
evictions count pages.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Iterable
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, ProcessCollector
from prometheus_client import generate_latest, start_http_server

from hicache.errors import ConfigError, HiCacheError

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

TIERS = ("device", "host", "disk")
# The RPC methods a daemon serves; the daemon passes its own table if it differs.
RPC_METHODS = (
    "hello", "register", "match", "load", "load_done", "insert", "backup", "backup_done",
    "evict", "release", "stats", "flush", "evict_tier", "ls", "subscribe",
)
OTHER_METHOD = "other"
# The daemon's native paths and what each can run as (hicache/daemon/serve/native_paths.py).
NATIVE_PATHS = ("index", "frame_loop", "disk_writer", "copy")
NATIVE_STATES = ("native", "python", "unused")
MAX_NAMESPACE_SERIES = 256  # namespaces with per-namespace series; the largest are kept
MAX_MODEL_LABEL = 64  # characters of a model name in a label
# Unix-socket round trips take 10-60 us (LIMITS.md); big loads take longer.
RPC_LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5,
)
# From a 30 us random page read to a batched multi-MB LMDB commit.
DISK_LATENCY_BUCKETS_S = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0,
)
_LABEL_VALUE = re.compile(r"[a-z_][a-z0-9_]*")


class MetricsError(HiCacheError, ValueError):
    """A metric update with an unknown label or an impossible value (a caller bug)."""


class MetricsServer:
    """A running /metrics HTTP endpoint; `close()` stops it and frees the port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.addr: str = server.server_address[0]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Metrics:
    """All of hicache's metrics in one private registry."""

    def __init__(
        self,
        *,
        tiers: Iterable[str] = TIERS,
        rpc_methods: Iterable[str] = RPC_METHODS,
        process_metrics: bool = True,
    ) -> None:
        self.tiers = tuple(tiers)
        self.rpc_methods = frozenset(rpc_methods)
        for value in (*self.tiers, *self.rpc_methods):
            _check_label(value)
        if not self.tiers:
            raise MetricsError("at least one tier is needed")
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        if process_metrics:
            ProcessCollector(registry=reg)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            # prometheus-client appends _total to counter samples.
            return Counter(name, doc, labels, registry=reg)

        self._capacity = gauge("hicache_tier_capacity_bytes", "Bytes the tier may hold.", ("tier",))
        self._used = gauge("hicache_tier_used_bytes", "Bytes of cached pages in the tier.", ("tier",))
        self._pages = gauge("hicache_tier_pages", "Cached pages in the tier.", ("tier",))
        self._hits = counter(
            "hicache_hits", "Pages found by match, by the best tier holding them.", ("tier",)
        )
        self._misses = counter("hicache_misses", "Pages asked for by match that no tier held.")
        self._moved = counter("hicache_bytes_moved", "Page bytes copied between tiers.", ("src", "dst"))
        self._evictions = counter("hicache_evictions", "Pages evicted from the tier.", ("tier",))
        self._requests = counter(
            "hicache_requests", "RPC requests answered, by result code.", ("method", "code")
        )
        self._rpc_latency = Histogram(
            "hicache_rpc_latency_seconds", "Time from a request's arrival to its answer.", ["method"],
            buckets=RPC_LATENCY_BUCKETS_S, registry=reg,
        )
        self._disk_latency = Histogram(
            "hicache_disk_latency_seconds", "Duration of disk tier operations.", ["op"],
            buckets=DISK_LATENCY_BUCKETS_S, registry=reg,
        )
        self._disk_faults = counter(
            "hicache_disk_faults", "Disk tier faults: environments moved aside, corrupt pages, write faults, "
            "pages dropped at the rebuild or refused for lack of their parent.", ("fault",)
        )
        self._remote_latency = Histogram(
            "hicache_remote_latency_seconds", "Duration of remote tier operations (probe: a match's lookup; "
            "fetch: match to verified in host; put: queued to stored).", ["op"],
            buckets=DISK_LATENCY_BUCKETS_S, registry=reg,
        )
        self._remote_pages = counter(
            "hicache_remote_pages", "Remote tier pages and errors by outcome (written_pages, miss_pages, "
            "dropped_pages, failed_writes, corrupt_records, errors).", ("what",)
        )
        self._remote_up = gauge("hicache_remote_up", "1 while the remote store answers (circuit breaker closed).")
        self._remote_backend = gauge("hicache_remote_backend", "1 for the remote tier's store kind (redis, "
                                     "mooncake).", ("backend",))
        self._recomputed = counter(
            "hicache_recompute_pages", "Pages on disk or in the remote store a match left to be recomputed, "
            "the engine computing them faster than the tier reads them.", ("tier",)
        )
        self._disk_degraded = gauge("hicache_disk_degraded", "1 while the disk tier is degraded (writes refused).")
        self._engines = gauge("hicache_engines_connected", "Engine connections currently open.")
        self._queue_depth = gauge("hicache_queue_depth", "Items waiting in a daemon work queue.", ("queue",))
        self._dropped_subscribers = counter(
            "hicache_dropped_subscribers", "Event subscribers closed for falling behind."
        )
        self._dropped_connections = counter(
            "hicache_dropped_connections", "Connections closed over a buffer cap, by which cap.", ("reason",)
        )
        ns_labels = ("namespace", "model", "tier")
        self._ns_pages = gauge("hicache_namespace_pages", "Cached pages of a namespace in a tier (namespace: "
                               "the salt's first 12 hex digits, as `hicache ls` prints it).", ns_labels)
        self._ns_bytes = gauge("hicache_namespace_bytes", "Bytes of a namespace's cached pages in a tier.",
                               ns_labels)
        self._ns_series: set[tuple[str, str, str]] = set()
        native = Enum("hicache_native_path", "Whether a hot path runs in C (native), in Python (the fallback, "
                      "slower) or not at all; `hicache stats` says why.", ["path"], states=list(NATIVE_STATES),
                      registry=reg)
        self._native_children = {p: native.labels(p) for p in NATIVE_PATHS}

        # Pre-resolved children: every series exists (at 0) from the start,
        # and hot-path updates skip prometheus-client's labels() lookup.
        self._tier_gauges = {
            t: (self._capacity.labels(t), self._used.labels(t), self._pages.labels(t)) for t in self.tiers
        }
        self._hit_children = {t: self._hits.labels(t) for t in self.tiers}
        self._eviction_children = {t: self._evictions.labels(t) for t in self.tiers}
        self._moved_children = {
            (s, d): self._moved.labels(s, d) for s in self.tiers for d in self.tiers if s != d
        }
        self._latency_children = {
            m: self._rpc_latency.labels(m) for m in (*sorted(self.rpc_methods), OTHER_METHOD)
        }
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._disk_children: dict[str, Histogram] = {}
        self._fault_children: dict[str, Counter] = {}
        self._queue_children: dict[str, Gauge] = {}

    # --- tiers ------------------------------------------------------------

    def set_tier(self, tier: str, capacity_bytes: int, used_bytes: int, pages: int) -> None:
        """The tier's current size; call after each allocation change or periodically."""
        gauges = self._tier(tier, self._tier_gauges)
        if capacity_bytes < 0 or used_bytes < 0 or pages < 0:
            raise MetricsError(
                f"tier {tier}: sizes must be >= 0 "
                f"(capacity={capacity_bytes}, used={used_bytes}, pages={pages})"
            )
        capacity, used, num_pages = gauges
        capacity.set(capacity_bytes)
        used.set(used_bytes)
        num_pages.set(pages)

    def add_hits(self, tier: str, pages: int = 1) -> None:
        self._tier(tier, self._hit_children).inc(_count(pages))

    def add_misses(self, pages: int = 1) -> None:
        self._misses.inc(_count(pages))

    def add_evictions(self, tier: str, pages: int = 1) -> None:
        self._tier(tier, self._eviction_children).inc(_count(pages))

    def add_bytes_moved(self, src: str, dst: str, nbytes: int) -> None:
        child = self._moved_children.get((src, dst))
        if child is None:
            raise MetricsError(f"no movement {src!r} -> {dst!r} between tiers {self.tiers}")
        child.inc(_count(nbytes))

    # --- RPC and disk -----------------------------------------------------

    def observe_rpc(self, method: str, seconds: float, code: str = "OK") -> None:
        """One answered request: latency by method, count by method and code."""
        if seconds < 0:
            raise MetricsError(f"RPC latency must be >= 0, got {seconds}")
        if method not in self.rpc_methods:
            method = OTHER_METHOD
        key = (method, code)
        child = self._request_children.get(key)
        if child is None:
            _check_code(code)
            child = self._request_children.setdefault(key, self._requests.labels(method, code))
        self._latency_children[method].observe(seconds)
        child.inc()

    def observe_disk(self, op: str, seconds: float) -> None:
        """One disk tier operation (``read``, ``write``, ``commit``, ``delete``...)."""
        if seconds < 0:
            raise MetricsError(f"disk latency must be >= 0, got {seconds}")
        child = self._disk_children.get(op)
        if child is None:
            _check_label(op)
            child = self._disk_children.setdefault(op, self._disk_latency.labels(op))
        child.observe(seconds)

    def add_disk_faults(self, fault: str, n: int = 1) -> None:
        """Disk faults by kind (``quarantined``, ``corrupt_pages``, ``write_faults``, ...)."""
        child = self._fault_children.get(fault)
        if child is None:
            _check_label(fault)
            child = self._fault_children.setdefault(fault, self._disk_faults.labels(fault))
        child.inc(_count(n))

    def add_recomputed(self, tier: str, pages: int = 1) -> None:
        """Pages of `tier` (disk, remote) not loaded because recomputing them was cheaper."""
        _check_label(tier)
        self._recomputed.labels(tier).inc(_count(pages))

    def set_disk_degraded(self, degraded: bool) -> None:
        self._disk_degraded.set(1 if degraded else 0)

    def observe_remote(self, op: str, seconds: float) -> None:
        _check_label(op)
        self._remote_latency.labels(op).observe(max(0.0, seconds))

    def add_remote(self, what: str, n: int = 1) -> None:
        _check_label(what)
        self._remote_pages.labels(what).inc(_count(n))

    def set_remote_up(self, up: bool, backend: str = "") -> None:
        self._remote_up.set(1 if up else 0)
        if backend:
            _check_label(backend)
            self._remote_backend.labels(backend).set(1)

    # --- daemon state -----------------------------------------------------

    def set_native(self, paths: dict[str, str]) -> None:
        """Each native path's state ("native", "python" or "unused"), as `stats` reports it."""
        bad = {p: s for p, s in paths.items() if p not in self._native_children or s not in NATIVE_STATES}
        if bad:
            raise MetricsError(f"unknown native paths or states: {bad}")
        for path, state in paths.items():
            self._native_children[path].state(state)

    def set_engines(self, count: int) -> None:
        self._engines.set(_count(count))

    def add_dropped_subscribers(self, count: int = 1) -> None:
        self._dropped_subscribers.inc(_count(count))

    def add_dropped_connections(self, reason: str, count: int = 1) -> None:
        """``output_overflows`` (unread replies) or ``input_overflows`` (unparsed input)."""
        _check_label(reason)
        self._dropped_connections.labels(reason).inc(_count(count))

    def set_queue_depth(self, queue: str, depth: int) -> None:
        depth = _count(depth)
        child = self._queue_children.get(queue)
        if child is None:
            _check_label(queue)
            child = self._queue_children.setdefault(queue, self._queue_depth.labels(queue))
        child.set(depth)

    def set_namespaces(self, usage: Iterable[tuple[str, str, dict[str, tuple[int, int]]]]) -> None:
        """Every namespace's (pages, bytes) per tier, as (namespace, model, {tier: (pages, bytes)}).
        Series of namespaces no longer given are removed; past MAX_NAMESPACE_SERIES namespaces
        only the largest are kept (labels stay bounded whatever tenants register)."""
        rows = sorted(usage, key=lambda u: -sum(b for _, b in u[2].values()))[:MAX_NAMESPACE_SERIES]
        values = {(namespace[:12], model[:MAX_MODEL_LABEL], tier): (_count(pages), _count(nbytes))
                  for namespace, model, tiers in rows for tier, (pages, nbytes) in tiers.items()}
        for key, (pages, nbytes) in values.items():  # all checked above: a bad row changes nothing
            self._ns_pages.labels(*key).set(pages)
            self._ns_bytes.labels(*key).set(nbytes)
        seen = set(values)
        for key in self._ns_series - seen:
            self._ns_pages.remove(*key)
            self._ns_bytes.remove(*key)
        self._ns_series = seen

    # --- exposition -------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format, as served on /metrics."""
        return generate_latest(self.registry)

    def start_http(
        self, port: int, addr: str = "127.0.0.1", *, allow_non_loopback: bool = False
    ) -> MetricsServer:
        """Serve /metrics from a background thread; port 0 picks a free port.

        Only loopback addresses are accepted unless ``allow_non_loopback``:
        the endpoint has no authentication, and cache statistics reveal
        traffic patterns of every tenant.
        """
        if not 0 <= port <= 65535:
            raise ConfigError(f"metrics port {port} is out of range 0..65535")
        if not allow_non_loopback:
            _require_loopback(addr)
        try:
            server, thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from e
        handle = MetricsServer(server, thread)
        logger.info("serving metrics on %s", handle.url)
        return handle

    def _tier(self, tier: str, children: dict[str, _T]) -> _T:
        child = children.get(tier)
        if child is None:
            raise MetricsError(f"unknown tier {tier!r}; known: {', '.join(self.tiers)}")
        return child


def _count(n: int) -> int:
    if n < 0:
        raise MetricsError(f"a count must be >= 0, got {n}")
    return n


def _check_label(value: str) -> None:
    if not _LABEL_VALUE.fullmatch(value):
        raise MetricsError(f"label value {value!r} must match [a-z_][a-z0-9_]*")


def _check_code(code: str) -> None:
    if not code or not code.replace("_", "").isalnum():
        raise MetricsError(f"result code {code!r} must be alphanumeric (with underscores)")


def _require_loopback(addr: str) -> None:
    """Every address ``addr`` resolves to must be a loopback address."""
    try:
        resolved = {ipaddress.ip_address(addr)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ConfigError(f"metrics address {addr!r} does not resolve: {e}") from None
        resolved = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    public = sorted(str(a) for a in resolved if not a.is_loopback)
    if public:
        raise ConfigError(
            f"metrics address {addr!r} is not loopback ({', '.join(public)}); the endpoint is "
            "unauthenticated, pass allow_non_loopback=True to expose it anyway"
        )
