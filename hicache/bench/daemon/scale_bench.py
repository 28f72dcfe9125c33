"""`hicache bench scale`: a daemon filled to production size, next to redis-server.

In one run, each step its own real process:

1. redis-server holds `pages` values of a page's size: memory per key, then
   `SAVE`, kill -9 and the restart until it answers with every key
   (hicache/bench/daemon/scale_redis.py);
2. a daemon (`--host-capacity`, `--disk-capacity`, default write-through,
   metrics on) is filled by one engine process on the vLLM connector's path
   (hicache/bench/daemon/scale_workload.py): `match` p50 is timed at `small_pages`
   and again at `pages`, the fill rate with the daemon's CPU per page;
3. after `settle`, the event loop's stall under `stats`, `ls`, `quota_list`,
   a metrics scrape and an idle second (the metrics refresher, the GC steward)
   is timed by a probe process (hicache/bench/daemon/scale_probe.py), and the heap
   (RssAnon) and the LMDB map's resident pages are read per page;
4. kill -9 and a restart on the same state directory: the time to answering,
   the pages restored against the pages counted on disk before the kill, the
   heap after against before.

Every figure is the daemon's own (its stats, its /proc), next to redis's where
they compare. The 1M-page run takes minutes and a few GiB; `--pages 20000`
runs in a test (tests/bench/test_scale_bench.py).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.daemon import scale_redis
from hicache.bench.daemon.scale_probe import LoopProbe, cpu_seconds, mapped_rss_kib, memory_kib
from hicache.bench.daemon.scale_workload import LAYOUT, Engine, Workload
from hicache.bench.report import row
from hicache.client.connection import RpcConnection
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.errors import HiCacheError

SETTLE_TIMEOUT_S = 1800.0


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--pages", type=int, default=1_000_000, help="pages to store (512 bytes, 16 tokens each)")
    b.add_argument("--small-pages", type=int, default=10_000,
                   help="the small size `match` is timed at too (at most half of --pages)")
    b.add_argument("--host-capacity", default="1GiB")
    b.add_argument("--disk-capacity", default="3GiB", help="the disk tier (its LMDB file, allocated whole)")
    b.add_argument("--in-flight", type=int, default=32, help="requests per engine step")
    b.add_argument("--match-samples", type=int, default=2000, help="`match` round trips timed at each size")
    b.add_argument("--daemon-config", help="a TOML file passed to the daemon (e.g. disk_queue_pages)")
    b.add_argument("--no-redis", action="store_true", help="skip redis-server (no baselines)")
    b.add_argument("--workdir", help="where the state directories go, kept (default: a temporary directory, "
                                     "removed at the end)")
    b.add_argument("--index-only", action="store_true",
                   help="no daemon, no redis: the index in-process at --pages, its heap per page and the restart's "
                        "work on its records (hicache/bench/daemon/scale_index.py: sizes a daemon here cannot fill)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _admin(sock: str) -> RpcConnection:
    conn = RpcConnection.connect(sock, timeout_s=60)
    conn.hello(timeout_s=60)
    return conn


def _settle(conn: RpcConnection) -> float:
    """Seconds until every disk write queued so far is committed."""
    t0 = time.monotonic()
    while not conn.call("settle", {"timeout_s": 60}, timeout_s=120)["settled"]:
        if time.monotonic() - t0 > SETTLE_TIMEOUT_S:
            raise HiCacheError(f"the disk tier did not settle within {SETTLE_TIMEOUT_S:g}s")
    return time.monotonic() - t0


def _fill(engine: Engine, pid: int, pages: int) -> tuple[float, float]:
    """Store `pages` more pages; (seconds, the daemon's CPU seconds) spent."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    engine.fill(pages)
    engine.client.wait_posted()  # the last put_done handled before anyone settles
    return time.monotonic() - t0, cpu_seconds(pid) - cpu0


def _loop_stalls(sock: str, admin: RpcConnection, metrics_port: int, workdir: Path) -> dict[str, tuple[float, float]]:
    """(longest stall of the loop, longest call) per operation, in seconds."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    ops: dict[str, Any] = {
        "stats": lambda: admin.call("stats", {}, timeout_s=120),
        "ls": lambda: admin.call("ls", {"depth": 2}, timeout_s=600),
        "quota_list": lambda: admin.call("quota_list", {}, timeout_s=120),
        "metrics scrape": lambda: urllib.request.urlopen(url, timeout=120).read(),
        "idle second (metrics refresher, gc)": lambda: time.sleep(1.0),
    }
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    with LoopProbe(sock, workdir) as probe:
        q0 = time.monotonic()
        time.sleep(1.0)
        q1 = time.monotonic()
        for _ in range(3):
            for name, op in ops.items():
                a = time.monotonic()
                op()
                windows[name].append((a, time.monotonic()))
                time.sleep(0.1)
    quiet = probe.quiet_s(q0, q1)
    return {name: (max(probe.stall(a, b, quiet) for a, b in w), max(b - a for a, b in w))
            for name, w in windows.items()}


def _disk(conn: RpcConnection) -> dict:
    return conn.call("stats", {}, timeout_s=120)["tiers"]["disk"]


def _hicache(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    metrics_port = _free_port()
    flags = ["--host-capacity", args.host_capacity, "--disk-capacity", args.disk_capacity,
             "--metrics-port", str(metrics_port)]
    if args.daemon_config:
        flags += ["--config", args.daemon_config]
    d = LocalDaemon(workdir / "hicache", *flags)
    d.start(timeout_s=600)
    out: dict[str, Any] = {}
    engine = Engine(d.socket, Workload(in_flight=args.in_flight))
    try:
        assert d.proc is not None
        pid = d.proc.pid
        engine.connect()
        admin = _admin(d.socket)
        mem0 = memory_kib(pid)
        small = max(1, min(args.small_pages, args.pages // 2))
        fill_s, fill_cpu = _fill(engine, pid, small)
        _settle(admin)
        out["match_small"] = engine.time_matches(args.match_samples)
        out["small_pages"] = admin.call("stats", {}, timeout_s=120)["puts"]["committed_pages"]
        out["mem_small"] = memory_kib(pid)
        s, c = _fill(engine, pid, args.pages - engine.report.put_pages)
        fill_s, fill_cpu = fill_s + s, fill_cpu + c
        out["fill_match_s"] = list(engine.report.match_s)
        backlog = _disk(admin)
        out["settle_s"] = _settle(admin)
        out["match_big"] = engine.time_matches(args.match_samples)
        st = admin.call("stats", {}, timeout_s=120)
        out.update(fill_s=fill_s, fill_cpu_s=fill_cpu, report=engine.report, stats=st, backlog_at_end=backlog)
        out["stalls"] = _loop_stalls(d.socket, admin, metrics_port, workdir)
        _settle(admin)
        out["disk_before"] = _disk(admin)
        out["mem0"], out["mem1"] = mem0, memory_kib(pid)
        out["lmdb_kib"] = mapped_rss_kib(pid, "data.mdb")
        admin.close()
        engine.close()
        d.stop(signal.SIGKILL)
        t0 = time.monotonic()
        d.start(timeout_s=3600)
        admin = _admin(d.socket)
        out["restart_s"] = time.monotonic() - t0  # answering (a big tier is indexed meanwhile)
        _settle(admin)  # waits until every page is indexed
        out["indexed_s"] = time.monotonic() - t0
        out["disk_after"] = _disk(admin)
        assert d.proc is not None
        out["mem_restart"] = memory_kib(d.proc.pid)
        admin.close()
    finally:
        engine.close()
        d.stop(signal.SIGKILL)
    log = d.read_log()
    out["log"] = {"broken_pipes": log.count("Broken pipe"), "records_skipped": log.count("records skipped"),
                  "prefix_gone": log.count("whose prefix is gone")}
    out["restart_parts"] = _restart_parts(log)
    return out


def _restart_parts(log: str) -> str:
    """What the daemon's log says the last start's disk part took (disk_mover.py, disk_restore.py)."""
    last = None
    for last in re.finditer(r"pages restored \((open and scan [^;]+);|pages to index while the daemon answers "
                            r"\((opened and read in [0-9.]+s)\)", log):
        pass
    if last is None:
        return "?"
    if last.group(1):
        return f"{last.group(1)}; indexed before answering"
    indexed = re.findall(r"pages indexed ([0-9.]+s after the daemon answered) \((records checked [0-9.]+s)\)",
                         log[last.end():])
    return "; ".join([last.group(2), *(f"{b}, {a}" for a, b in indexed[-1:])])


def _ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else 0.0


def run(args: argparse.Namespace) -> list[dict]:
    if args.index_only:
        from hicache.bench.daemon import scale_index

        return scale_index.run(args)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return _run(args, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="hicache-scale-") as tmp:  # the state dirs take GiBs: not left behind
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, workdir: Path) -> list[dict]:
    load0 = os.getloadavg()[0]
    redis = None if args.no_redis else scale_redis.measure(workdir, args.pages, LAYOUT.page_bytes)
    h = _hicache(args, workdir)
    load1 = os.getloadavg()[0]
    rows: list[dict] = [row("load average (1 min) at the start", load0, "", note=f"{load1:.2f} at the end")]
    st, rep = h["stats"], h["report"]
    committed = st["puts"]["committed_pages"]
    pages_m = committed / 1e6
    rows.append(row("pages stored (put_done, committed)", committed, "pages"))
    rows.append(row("fill rate", committed / h["fill_s"], "pages/s",
                    note=f"one engine, {args.in_flight} requests per step"))
    rows.append(row("daemon CPU per page stored", h["fill_cpu_s"] / max(1, committed) * 1e6, "us/page"))
    rows.append(row(f"match p50 at {committed} pages", _ms(h["match_big"], 50), "ms", _ms(h["match_small"], 50),
                    f"at {h['small_pages']} pages"))
    slow = sum(1 for x in h["fill_match_s"] if x > 0.1)
    rows.append(row("match p99 / max during the fill", _ms(h["fill_match_s"], 99), "ms",
                    note=f"max {_ms(h['fill_match_s'], 100):.1f} ms; {slow} of {len(h['fill_match_s'])} over 100 ms"))
    gc = st.get("gc") or {}
    if gc.get("managed"):
        rows.append(row("gc: longest managed pass", gc["max_pass_ms"], "ms",
                        note=f"{gc['passes']} passes, start-up pass {gc['startup_pass_ms']:.0f} ms"))
    heap_b = (h["mem1"]["RssAnon"] - h["mem0"]["RssAnon"]) * 1024 / max(1, committed)
    rows.append(row("daemon heap (RssAnon) per page", heap_b, "B/page", redis.bytes_per_key if redis else None,
                    "redis-server used_memory per key beyond the value" if redis else None))
    grown = committed - h["small_pages"]
    added_kib = h["mem1"]["RssAnon"] - h["mem_small"]["RssAnon"]
    rows.append(row("daemon heap per page added after the first pages", added_kib * 1024 / max(1, grown), "B/page",
                    note=f"from {h['small_pages']} to {committed} pages: what a larger index costs a page"))
    rows.append(row("LMDB map resident per page (page cache)", h["lmdb_kib"] * 1024 / max(1, committed), "B/page",
                    note="reclaimable: the map's file pages"))
    for name, (stall, call) in h["stalls"].items():
        rows.append(row(f"event loop stall: {name}", stall * 1e3, "ms", note=f"the call took {call * 1e3:.1f} ms"))
    disk0, disk1 = h["disk_before"], h["disk_after"]
    end = h["backlog_at_end"]
    rows.append(row("disk write backlog at the end of the fill", end.get("backlog_pages", 0) + end["queue_depth"],
                    "pages", note=f"settled in {h['settle_s']:.1f} s"))
    rows.append(row("written-through pages on disk after settle", disk0["pages"], "pages", rep.distinct_pages,
                    "distinct pages stored", note=f"skipped_writes {disk0['skipped_writes']}, "
                                                  f"evicted from disk {disk0['evicted_pages']}, "
                                                  f"puts refused for want of host room {st['puts']['skipped_no_space']}"))
    rows.append(row("disk pages restored after kill -9", disk1["restored_pages"], "pages", disk0["pages"],
                    "counted on disk before the kill",
                    note=f"orphans_dropped {disk1['orphans_dropped']}, log: {h['log']}"))
    rows.append(row("restart to answering", h["restart_s"], "s", redis.restart_s if redis else None,
                    "redis-server load of its save file" if redis else None,
                    note=f"{h['restart_s'] / max(pages_m, 1e-6):.1f} s per million pages ({h['restart_parts']})"))
    rows.append(row("restart until every page is indexed", h["indexed_s"], "s", redis.restart_s if redis else None,
                    "redis-server load of its save file" if redis else None,
                    note="a tier of more than restore_sync_pages is indexed while the daemon answers"))
    rows.append(row("heap after restart vs before the kill", h["mem_restart"]["RssAnon"] / 1024, "MiB",
                    h["mem1"]["RssAnon"] / 1024, "before the kill"))
    rows.append(row("engine deadline misses during the fill", rep.late, "",
                    note=f"calls past their deadline (a miss or a skipped store, the connection kept) of "
                         f"{rep.requests * 2} waited; {rep.late_reasons or 'none logged'}"))
    rows.append(row("engine outages during the fill", rep.outages, "",
                    note=f"connections given up; stores skipped {rep.skipped_puts}, misses while away "
                         f"{rep.misses_while_away}, refusals {rep.refusals}, daemon log broken pipes "
                         f"{h['log']['broken_pipes']}; {rep.reasons or 'no reasons logged'}"))
    if redis is not None:
        rows.append(row("redis-server: SET rate (pipelined)", redis.keys / redis.fill_s, "keys/s",
                        note=f"SAVE {redis.save_s:.1f} s, RSS {redis.rss_before_kib // 1024} MiB before, "
                             f"{redis.rss_after_kib // 1024} MiB after the restart"))
    return rows
