"""`hicache bench pauses`: the daemon's tail latency with a large index under write load.

A long pause of the event loop (a full garbage collection over the index, a
long handler) costs every engine waiting on it, and p99 hides it: this bench
reports p50 / p99 / p99.9 / max of `match` round trips, with the daemon's
collector managed (`managed_gc`, the default, hicache/daemon/serve/gc_steward.py) and
left to CPython (the baseline), in one run:

1. a daemon with a host and a disk tier is filled with `nodes` index nodes
   (host puts of prompts branching off shared prefixes, one new leaf each);
2. for `seconds`, one client process times `match` (+ an untimed `release`) of
   a cached 64-page prompt back to back, while a loader process keeps putting
   new prompts, so the index grows and the disk writer and its hasher run.

Each configuration gets the same daemon flags, the same prompts, and its own
daemon process.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.bench.report import row
from hicache.client.connection import RpcConnection
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.index.keys import page_keys
from hicache.layout import KVLayout

LAYOUT = KVLayout("mha", num_layers=1, page_size=16, dtype="float16", num_kv_heads=1, head_dim=16)  # 1 KiB pages
PREFIXES, PREFIX_PAGES = 64, 8


def _register(path: str) -> tuple[RpcConnection, int, bytes]:
    conn = RpcConnection.connect(path, timeout_s=30)
    conn.hello()
    reg = conn.call("register", {"model": "bench-pauses", "layout": LAYOUT.to_dict(), "device_pages": 4096})
    return conn, reg["engine"], reg["salt"]


def _prompts(seed: int) -> tuple[np.random.Generator, np.ndarray]:
    """The shared prefixes (the same in every process) and a generator of leaves."""
    prefixes = np.random.default_rng(0).integers(1, 30000, (PREFIXES, PREFIX_PAGES * LAYOUT.page_size))
    return np.random.default_rng(seed), prefixes.astype(np.int32)


def _put_prompts(path: str, count: int, seed: int, until: float | None = None) -> int:
    """Host-put `count` prompts (or as many as fit before `until`): a random prefix's first
    1..8 pages, then one page of its own -- about one new node each."""
    conn, engine, salt = _register(path)
    rng, prefixes = _prompts(seed)
    ps = LAYOUT.page_size
    done = 0
    while done < count and (until is None or time.monotonic() < until):
        k = int(rng.integers(1, PREFIX_PAGES + 1))
        toks = np.concatenate([prefixes[int(rng.integers(PREFIXES))][: k * ps],
                               rng.integers(1, 30000, ps).astype(np.int32)])
        keys = b"".join(page_keys(salt, toks, ps))
        r = conn.call("put", {"engine": engine, "keys": keys, "tokens": toks.tobytes()})
        if r["put"] is not None:  # the copies would go here; their bytes do not matter to this bench
            conn.call("put_done", {"engine": engine, "put": r["put"], "ok": True})
        done += 1
    conn.close()
    return done


def _loader(path: str, seed: int, seconds: float, q: mp.Queue) -> None:
    q.put(_put_prompts(path, 1 << 62, seed, time.monotonic() + seconds))


def _timer(path: str, seconds: float, q: mp.Queue) -> None:
    conn, engine, salt = _register(path)
    _, prefixes = _prompts(0)
    toks = np.concatenate(prefixes[:8])  # 64 pages, put below so they hit
    keys = b"".join(page_keys(salt, toks, LAYOUT.page_size))
    r = conn.call("put", {"engine": engine, "keys": keys, "tokens": toks.tobytes()})
    if r["put"] is not None:
        conn.call("put_done", {"engine": engine, "put": r["put"], "ok": True})
    lat: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        m = conn.call("match", {"engine": engine, "keys": keys})
        lat.append(time.perf_counter() - t0)
        conn.call("release", {"pin": m["pin"]})
    conn.close()
    q.put(np.asarray(lat))


def _one(workdir: Path, managed: bool, nodes: int, seconds: float, flags: list[str]) -> tuple[np.ndarray, dict]:
    env = {"HICACHE_MANAGED_GC": "1" if managed else "0"}
    with LocalDaemon(workdir, *flags, env=env) as daemon:
        _put_prompts(daemon.socket, nodes, seed=1)
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_timer, args=(daemon.socket, seconds, q)),
                 ctx.Process(target=_loader, args=(daemon.socket, 2, seconds, q))]
        for p in procs:
            p.start()
        got = [q.get(timeout=seconds + 300) for _ in procs]
        for p in procs:
            p.join()
        lat = next(x for x in got if isinstance(x, np.ndarray))
        stats = RpcConnection.one_call(daemon.socket, "stats", timeout_s=30)
    return lat, stats


def run(nodes: int = 100_000, seconds: float = 30.0, workdir: str | None = None) -> list[dict]:
    base = Path(workdir or tempfile.mkdtemp(prefix="hicache-bench-pauses-"))
    flags = ["--host-capacity", f"{max(64, nodes * 2 * LAYOUT.page_bytes >> 20)}MiB",
             "--disk-capacity", f"{max(256, nodes * 4 * LAYOUT.page_bytes >> 20)}MiB"]
    results = {m: _one(base / ("managed" if m else "cpython"), m, nodes, seconds, flags) for m in (False, True)}
    rows = []
    (b_lat, _), (m_lat, m_stats) = results[False], results[True]
    for label, q in (("p50", 50), ("p99", 99), ("p99.9", 99.9), ("max", 100)):
        rows.append(row(f"match {label}, managed gc", float(np.percentile(m_lat, q)) * 1e3, "ms",
                        float(np.percentile(b_lat, q)) * 1e3, "CPython's gc"))
    rows.append(row("matches timed, managed gc", len(m_lat), "calls", len(b_lat), "CPython's gc"))
    gc_stats = m_stats.get("gc", {})
    rows.append(row("longest managed gc pass", gc_stats.get("max_pass_ms", 0.0), "ms",
                    note=f"{gc_stats.get('passes')} passes, {gc_stats.get('frozen_objects')} objects frozen"))
    rows.append(row("host pages at the end, managed gc", m_stats["tiers"]["host"]["pages"], "pages"))
    return rows
