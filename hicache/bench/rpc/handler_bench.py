"""`hicache bench rpc --calls handlers`: the daemon's CPU for one `match` + `release`,
in-process, without sockets, by stage, against the per-frame work of the echo server
measured in the same run (msgpack decode of the same request frames, encode of the
replies): what a native frame loop or match path would have to beat.

A real daemon (hicache.daemon.serve.app.Daemon, no disk tier) is started inside this
process on a private socket; its handlers are called as the RPC server calls them,
with a real server-side Connection as the caller (no transport: nothing is sent).
Each stage is timed over `requests` calls in a tight loop, `repeats` rounds taking
turns, and reported as the median round's mean (`best_us` in --json: the fastest
round's, steadier for comparing two trees on a busy machine); hot caches make these floors, below
what a round trip between two processes pays (see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hicache.bench.report import row
from hicache.bench.rpc.rpc_bench import LAYOUT
from hicache.config import Config
from hicache.daemon.serve.app import Daemon
from hicache.index.keys import PackedKeys, page_keys
from hicache.rpc.framing import ids_to_bytes, new_packer, pack_frame, unpack_body
from hicache.rpc.connection import Connection


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    for _ in range(min(n, 200)):  # warm
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


async def _measure(prompt_tokens: int, requests: int, repeats: int) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="hicache-handler-bench-"))
    daemon = Daemon(Config(socket_path=tmp / "d.sock", host_capacity=256 << 20, disk_enabled=False,
                           managed_gc=False))
    await daemon.startup()
    try:
        h = daemon.server.handlers
        conn = Connection(daemon.server)
        conn.greeted = True
        reg = h["register"](conn, {"model": "bench", "layout": LAYOUT.to_dict(), "device_pages": 4096})
        engine = reg["engine"]
        tokens = np.random.default_rng(0).integers(0, 1 << 30, prompt_tokens, dtype=np.int32)
        keys = b"".join(page_keys(reg["salt"], tokens, LAYOUT.page_size))
        n_pages = len(keys) // 16
        r = h["insert"](conn, {"engine": engine, "keys": keys, "tokens": tokens.tobytes(),
                               "device_pages": ids_to_bytes(np.arange(1, n_pages + 1))})
        if r["backup"]:
            h["backup_done"](conn, {"backup": r["backup"]["id"]})
        svc, index = daemon.service, daemon.service.engines[engine].ns.index
        params = {"engine": engine, "keys": keys}
        match_frame = memoryview(pack_frame({"id": 1, "method": "match", "params": params}))[4:]
        probe = h["match"](conn, params)
        if len(probe["device_pages"]) != 4 * n_pages:
            raise RuntimeError(f"the bench's match found {len(probe['device_pages']) // 4} of {n_pages} pages")
        release_frame = memoryview(pack_frame({"id": 2, "method": "release", "params": {"pin": probe["pin"]}}))[4:]
        h["release"](conn, {"pin": probe["pin"]})
        match_reply = {"id": 1, "result": probe}
        packer = new_packer()

        def handlers() -> None:
            m = h["match"](conn, params)
            h["release"](conn, {"pin": m["pin"]})

        fast_match, fast_release = h["match"].fast, h["release"].fast  # the native frame loop's calls

        def fast() -> None:  # what the C frame loop calls per match and release (C parses and encodes)
            fast_release(conn, fast_match(conn, engine, keys)[0], None)

        def service() -> None:
            svc.release(conn, svc.match(conn, engine, PackedKeys(keys)).pin_id)

        def walk() -> None:
            index.match(PackedKeys(keys), engine)

        def frames() -> None:  # the echo server's work for the same two requests
            unpack_body(match_frame)
            packer.pack(match_reply)
            unpack_body(release_frame)
            packer.pack({"id": 2, "result": True})

        stages = {"handlers": handlers, "fast": fast, "service": service, "walk": walk, "frames": frames}
        rounds: dict[str, list[float]] = {k: [] for k in stages}
        for _ in range(repeats):
            for name, fn in stages.items():
                rounds[name].append(_per_call_us(fn, requests))
        med = {k: float(np.median(v)) for k, v in rounds.items()}
        best = {k: float(np.min(v)) for k, v in rounds.items()}  # the least disturbed round, for A/B on a busy machine
        label = f"{prompt_tokens} tokens, in-process"
        return [
            row(f"match + release handlers, {label}", med["handlers"], "us", baseline=med["frames"],
                baseline_name="echo frames", repeats=repeats, best_us=best["handlers"],
                best_baseline_us=best["frames"]),
            row(f"match + release fast handlers (native frame loop), {label}", med["fast"], "us",
                baseline=med["handlers"], baseline_name="handlers", repeats=repeats, best_us=best["fast"],
                best_baseline_us=best["handlers"]),
            row(f"  of which CacheService match + release, {label}", med["service"], "us", repeats=repeats,
                best_us=best["service"]),
            row(f"  of which the radix walk (RadixIndex.match), {label}", med["walk"], "us", repeats=repeats,
                best_us=best["walk"]),
        ]
    finally:
        await daemon.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def run(prompt_tokens: int = 8192, requests: int = 2000, repeats: int = 5) -> list[dict]:
    return asyncio.run(_measure(prompt_tokens, requests, repeats))
