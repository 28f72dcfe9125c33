"""`bench trace --remote`: the remote tier under the trace replay, with and without its admission.

A local redis-server (hicache/bench/procs/redis_procs.py) is the daemon's remote tier, its
`maxmemory` set to `--remote-capacity` with allkeys-lru, as a shared store runs: small
enough that the store fills, which is when admission (hicache/daemon/movers/remote_admission.py)
starts turning pages away -- while the store has room every page is written in both modes.
The trace is replayed once per `--remote-admission` mode, each against a fresh store and
daemon. Reported per mode: the pages the remote tier served (its hits: pages the device,
host and disk lacked), the pages and bytes it wrote, and pages and bytes written per
remote hit -- the measure `disk pages written per disk hit` gives the disk -- each against
the first mode's (by default `all`: every page written, as before admission).

The replay settles the remote writes between requests (as it does the disk's) and
lets lookups wait for the store, so that the counts are the policy's, not the timing's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache.bench.procs.redis_procs import LocalRedis
from hicache.bench.report import row
from hicache.config import parse_size

REMOTE_MODES = ("all", "reuse")


def remote_rows(args: Any, trace: list[dict], replay_fresh: Callable[..., dict[str, Any]]) -> list[dict]:
    """Replay `trace` once per remote admission mode (`replay_fresh(args, trace, env)` starts
    the daemon) and compare the remote tier's writes per hit across the modes."""
    modes = list(dict.fromkeys(args.remote_admission or REMOTE_MODES))
    capacity = parse_size(args.remote_capacity)
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="hicache-trace-redis-") as tmp:
            redis = LocalRedis(Path(tmp)).start()
            try:
                redis.nodes[0].cmd("CONFIG", "SET", "maxmemory", str(capacity))
                # A match never waits for the store: its remote part counts when the replay's
                # client asks again while the match says `pending` (load until=complete).
                res = replay_fresh(args, trace, {"HICACHE_REMOTE_URL": redis.url, "HICACHE_REMOTE_ADMISSION": mode,
                                                 "HICACHE_REMOTE_NEGATIVE_TTL_S": "0"})
            finally:
                redis.stop()
        remote = res["stats"]["tiers"].get("remote")
        if remote is None:
            raise RuntimeError("the daemon ran without its remote tier (see its log)")
        t = res["totals"]
        out[mode] = {"hits": remote["hit_pages"], "written": remote["written_pages"],
                     "bytes": remote["bytes_written"], "rejected": remote["admission"]["rejected_pages"],
                     "dropped": remote["dropped_pages"],
                     "hit_rate": (t["device"] + t["host"] + t["disk"]) / max(1, t["prompt"])}
    base_name = modes[0]
    base = out[base_name]
    rows = [row("remote tier: store capacity", capacity, "bytes", page_bytes=args.page_bytes)]
    for mode, r in out.items():
        label = f"remote admission {mode}"
        per_hit = r["written"] / max(1, r["hits"])  # no remote hit: all the writes
        bytes_per_hit = r["bytes"] / max(1, r["hits"])
        rows += [
            row(f"{label}: hit rate, all tiers", r["hit_rate"], "fraction", baseline=base["hit_rate"],
                baseline_name=base_name),
            row(f"{label}: remote hit pages", r["hits"], "pages", baseline=base["hits"], baseline_name=base_name),
            row(f"{label}: remote pages written", r["written"], "pages", baseline=base["written"],
                baseline_name=base_name, turned_away=r["rejected"], dropped=r["dropped"]),
            row(f"{label}: remote pages written per remote hit", per_hit, "pages",
                baseline=base["written"] / max(1, base["hits"]), baseline_name=base_name),
            row(f"{label}: remote bytes written per remote hit", bytes_per_hit, "bytes",
                baseline=base["bytes"] / max(1, base["hits"]), baseline_name=base_name),
        ]
    return rows
