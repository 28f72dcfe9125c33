"""`hicache bench soak`: many engines cycling against one daemon for minutes.

Each client is a real engine-side cache (HiCacheClient + EngineCache over a small
CPU device pool, so it evicts): it looks prompts up (match, load from host or
disk, load_done), stores what it computed (insert, the write-through backup,
backup_done), releases, and every few dozen requests disconnects and connects
again. Prompts share prefixes drawn from a small set, so the tree branches and
clients hit each other's pages.

Reported: requests served, the daemon's memory (VmRSS and its heap, RssAnon) once
warmed up and again after every client has gone, and whether every host slot is
accounted for at the end (host pages in use equal the host pages the index holds;
no pins or planned backups left). The soak test in tests/robustness asserts on the
same numbers.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.bench.report import row
from hicache.client.connection import RpcConnection
from hicache.daemon.serve.launcher import LocalDaemon

PAGE_SIZE = 4
POOL_PAGES = 96  # per client: small enough that clients evict, large enough for one request
PROMPTS = 16  # shared prefixes


@dataclass(slots=True)
class SoakResult:
    clients: int
    seconds: float
    requests: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)
    memory_warm_kib: dict[str, int] = field(default_factory=dict)
    memory_end_kib: dict[str, int] = field(default_factory=dict)
    memory_max_kib: dict[str, int] = field(default_factory=dict)
    host_pages_used: int = -1
    host_pages_indexed: int = -1
    pins: int = -1
    pending_backups: int = -1
    engines: int = -1

    def summary(self) -> str:
        w, e, m = self.memory_warm_kib, self.memory_end_kib, self.memory_max_kib
        return (f"soak: {self.clients} clients, {self.seconds:.0f}s, {self.requests} requests, {self.reconnects} "
                f"reconnects, {len(self.errors)} client errors; daemon VmRSS warm {w.get('VmRSS')} KiB -> end "
                f"{e.get('VmRSS')} KiB (max {m.get('VmRSS')}), RssAnon warm {w.get('RssAnon')} -> end "
                f"{e.get('RssAnon')} KiB (max {m.get('RssAnon')}); host pages used {self.host_pages_used}, "
                f"indexed {self.host_pages_indexed}; pins {self.pins}, pending backups {self.pending_backups}, "
                f"engines {self.engines}")


def memory_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem"):
                out[name] = int(rest.split()[0])
    return out


def admin(socket: str, method: str, params: dict | None = None) -> Any:
    return RpcConnection.one_call(socket, method, params or {}, timeout_s=30.0)


def _engine(socket: str) -> Any:
    from hicache.client.client import HiCacheClient
    from hicache.client.engine_cache import EngineCache
    from hicache.layout import KVLayout
    from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
    from hicache.tiers.device.pool import DevicePool

    layout = KVLayout("mha", num_layers=2, page_size=PAGE_SIZE, dtype="float16", num_kv_heads=2, head_dim=8)
    pool = DevicePool(layout, num_slots=POOL_PAGES * PAGE_SIZE)
    client = HiCacheClient(layout, pool.num_pages, model="soak", socket_path=socket, timeout_s=10.0,
                           backoff_s=(0.02, 0.2))
    return EngineCache(client, pool, PagedTokenToKVPoolAllocator(pool.num_slots, PAGE_SIZE))


def _request(cache: Any, tokens: np.ndarray) -> None:
    """One request's cache traffic: lookup and load, compute (nothing), store, release."""
    prefix = cache.lookup(tokens)
    try:
        for layer in range(cache.pool.layout.num_layers):
            prefix.wait_layer(layer)
        cache.finish_load(prefix)
        new = cache.alloc_pages(len(tokens) // PAGE_SIZE - prefix.num_pages)
        if new is not None:
            cache.store(prefix, tokens, new)
    finally:
        cache.release(prefix)
    cache.poll()


class _Clients:
    def __init__(self, socket: str, count: int, seed: int) -> None:
        base = np.random.default_rng(seed)
        self.prompts = [base.integers(0, 50000, int(base.integers(32, 257)), dtype=np.int32) for _ in range(PROMPTS)]
        self.socket = socket
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = 0
        self.reconnects = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, idx: int) -> None:
        rng = np.random.default_rng([self.seed, idx])
        while not self.stop.is_set():
            try:
                cache = _engine(self.socket)
            except Exception as e:  # noqa: BLE001 - counted and reported
                self._error(idx, e)
                return
            try:
                for _ in range(int(rng.integers(5, 40))):
                    if self.stop.is_set():
                        break
                    base = self.prompts[int(rng.integers(len(self.prompts)))]
                    tail = rng.integers(0, 50000, int(rng.integers(1, 65)), dtype=np.int32)
                    _request(cache, np.concatenate([base[:int(rng.integers(0, len(base) + 1))], tail]))
                    with self.lock:
                        self.requests += 1
            except Exception as e:  # noqa: BLE001
                self._error(idx, e)
            finally:
                try:
                    cache.close()
                except Exception as e:  # noqa: BLE001
                    self._error(idx, e)
                with self.lock:
                    self.reconnects += 1

    def _error(self, idx: int, e: Exception) -> None:
        with self.lock:
            if len(self.errors) < 20:
                self.errors.append(f"client {idx}: {type(e).__name__}: {e}")

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)


def _quiescent(socket: str, timeout_s: float) -> dict:
    """stats once no pin, backup, engine or disk write is left (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = admin(socket, "stats")
        disk = st["tiers"].get("disk") or {}
        if (not st["pins"] and not st["pending_backups"] and not st["engines"] and not disk.get("queue_depth")) \
                or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def run_soak(socket: str, *, clients: int = 32, duration_s: float = 180.0, warmup_s: float | None = None,
             seed: int = 0) -> SoakResult:
    """Soak a running daemon (on this machine: its memory is read from /proc)."""
    pid = int(admin(socket, "stats")["pid"])
    warmup_s = duration_s * 0.3 if warmup_s is None else warmup_s
    res = SoakResult(clients, duration_s)
    workers = _Clients(socket, clients, seed)
    t0 = time.monotonic()
    workers.start()
    peak: dict[str, int] = {}
    while time.monotonic() - t0 < duration_s:
        now = memory_kib(pid)
        peak = {k: max(v, peak.get(k, 0)) for k, v in now.items()}
        if not res.memory_warm_kib and time.monotonic() - t0 >= warmup_s:
            res.memory_warm_kib = now
        time.sleep(0.5)
    workers.join(60.0)
    res.seconds = time.monotonic() - t0
    res.requests, res.reconnects, res.errors = workers.requests, workers.reconnects, list(workers.errors)
    stuck = [t.name for t in workers.threads if t.is_alive()]
    if stuck:
        res.errors.append(f"{len(stuck)} clients still running 60s after the end")
    st = _quiescent(socket, 60.0)
    indexed = sum(ns["pages"]["host"] for ns in admin(socket, "ls", {"depth": 0})["namespaces"])
    res.host_pages_used, res.host_pages_indexed = st["tiers"]["host"]["pages"], indexed
    res.pins, res.pending_backups, res.engines = st["pins"], st["pending_backups"], len(st["engines"])
    res.memory_end_kib = memory_kib(pid)
    res.memory_max_kib = {k: max(v, res.memory_end_kib.get(k, 0)) for k, v in peak.items()}
    return res


def run(args: Any) -> list[dict]:
    logging.getLogger("hicache.client").setLevel(logging.WARNING)  # a line per reconnect otherwise
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        daemon = None
        sock = args.socket_path
        if sock is None:
            daemon = LocalDaemon(tmp, "--host-capacity", args.host_capacity, "--disk-capacity",
                                 args.disk_capacity).start()
            sock = daemon.socket
        try:
            res = run_soak(sock, clients=args.clients, duration_s=args.seconds, seed=args.seed)
        finally:
            if daemon is not None:
                daemon.stop()
    w, e = res.memory_warm_kib, res.memory_end_kib
    return [
        row("clients", res.clients, "count"),
        row("requests", res.requests / max(res.seconds, 1e-9), "req/s"),
        row("reconnects", res.reconnects, "count"),
        row("client errors", len(res.errors), "count"),
        row("daemon VmRSS after all clients left", e.get("VmRSS", 0) / 1024, "MiB", w.get("VmRSS", 0) / 1024,
            "warmed up"),
        row("daemon RssAnon after all clients left", e.get("RssAnon", 0) / 1024, "MiB", w.get("RssAnon", 0) / 1024,
            "warmed up"),
        row("host pages in use minus indexed", res.host_pages_used - res.host_pages_indexed, "pages"),
        row("pins + pending backups left", res.pins + res.pending_backups, "count"),
    ]


def add_arguments(b: Any) -> None:
    b.add_argument("--socket", dest="socket_path", help="a running daemon on this machine (default: start one)")
    b.add_argument("--clients", type=int, default=32)
    b.add_argument("--seconds", type=float, default=180.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--host-capacity", default="32MiB")
    b.add_argument("--disk-capacity", default="32MiB")
