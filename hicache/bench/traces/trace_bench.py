"""`hicache bench trace`: replay a Mooncake-format trace against a real daemon.

Each request's 512-token blocks are mapped to deterministic token runs (block
id -> seeded tokens), so equal block ids are equal prefixes. One engine with a
deliberately small device pool serves the requests in order through the real
client (match, per-layer load of the host part, insert with write-through
backups, eviction under pressure); its pages are small (`--page-bytes`) so the
replay measures the cache policy, not the copy speed. Reported: the share of
prompt tokens served per tier and the tokens recomputed, next to bounds
simulated on the same block sequence (hicache/bench/policy/policy_sim.py): the
infinite cache (a block hits iff it and every block before it in the request
were seen earlier in the trace), Belady's offline optimum and the online
comparison set (LRU, segmented LRU, S3-FIFO, ARC, LFU with aging) at the
capacity of the host tier and of all tiers (host + disk pages, an upper bound
on the distinct blocks hicache can hold), plus at `--sim-fractions` of the
trace's unique blocks. `--sim-only` skips the daemon and prints just those.
`--workload` replaces the trace file by a generated one (hicache/bench/traces/workloads.py).
`--remote` replays it again with a local Redis as the remote tier, once per remote
admission mode, for the remote writes per remote hit (hicache/bench/traces/trace_remote.py).

Disk admission and placement: the daemon's disk writes per disk hit (pages written
to LMDB over pages served from disk), and an ablation simulated on the same blocks
(hicache/bench/policy/tiered_sim.py) at `--ablation-fractions` of the unique blocks, host
and disk split as the daemon's: each placement, admission on and off, and the
chosen policy less each ingredient, next to LRU of the same total capacity; and
device + host split as `--device-pages` to the host tier, each device-host placement
(hicache/bench/policy/device_host_sim.py). `--signals` adds structure signals as eviction
priorities (hicache/bench/policy/signal_sim.py) at the same fractions.
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import numpy as np

from hicache.bench.policy.device_host_sim import device_host_rows
from hicache.bench.policy.policy_sim import (
    HICACHE_POLICIES,
    ONLINE,
    BlockTrace,
    SimResult,
    block_trace,
    simulate_all,
)
from hicache.bench.policy.signal_sim import signal_rows
from hicache.bench.policy.tiered_sim import ablation_rows
from hicache.bench.report import row
from hicache.bench.traces.trace_files import open_trace
from hicache.bench.traces.trace_remote import remote_rows
from hicache.bench.traces.workloads import generate
from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.engine_cache import EngineCache
from hicache.config import parse_size
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.layout import KVLayout
from hicache.progress import Progress
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool

BLOCK = 512


def block_tokens(block_id: int) -> np.ndarray:
    return np.random.default_rng(block_id).integers(0, 1 << 20, BLOCK, dtype=np.int32)


def load_trace(path: str, limit: int | None) -> list[dict]:
    out = []
    with open_trace(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit and len(out) >= limit:
                    break
    return out


def optimum_hit_blocks(trace: list[dict]) -> tuple[int, int]:
    """(full blocks an infinite cache would serve, full blocks requested)."""
    seen: set[int] = set()
    hit = total = 0
    for req in trace:
        ids = req["hash_ids"]
        full = req["input_length"] // BLOCK
        total += full
        k = 0
        while k < full and ids[k] in seen:
            k += 1
        hit += k
        seen.update(ids[:full])
    return hit, total


def replay(sock: str, trace: list[dict], device_pages: int, page_bytes: int) -> dict[str, Any]:
    head_dim = max(1, page_bytes // (BLOCK * 2 * 2))  # one layer, one head, fp16 K and V
    layout = KVLayout("mha", num_layers=1, page_size=BLOCK, dtype="float16", num_kv_heads=1, head_dim=head_dim)
    pool = DevicePool(layout, device_pages * BLOCK)
    alloc = PagedTokenToKVPoolAllocator(pool.num_slots, BLOCK)
    client = HiCacheClient(layout, device_pages, model="trace-replay", socket_path=sock, timeout_s=30)
    cache = EngineCache(client, pool, alloc)
    admin = RpcConnection.connect(sock, timeout_s=30)  # settles the disk writes between requests
    admin.hello()
    blocks: dict[int, np.ndarray] = {}
    totals = {"prompt": 0, "full_block_tokens": 0, "device": 0, "host": 0, "disk": 0, "skipped": 0}
    ttft: list[float] = []
    t0 = time.time()
    shown = Progress("bench trace: replay", total=len(trace), unit="requests")
    for i, req in enumerate(trace, 1):
        n_tok = req["input_length"]
        full = n_tok // BLOCK
        ids = req["hash_ids"][:full]
        for b in ids:
            if b not in blocks:
                blocks[b] = block_tokens(b)
        tokens = np.concatenate([blocks[b] for b in ids]) if ids else np.empty(0, np.int32)
        t_req = time.perf_counter()
        prefix = cache.lookup(tokens)
        cache.finish_load(prefix)
        m = prefix.match
        totals["prompt"] += n_tok
        totals["full_block_tokens"] += full * BLOCK
        totals["device"] += m.device_len * BLOCK
        totals["host"] += (m.host_len - m.from_disk) * BLOCK if prefix.num_pages > m.device_len else 0
        totals["disk"] += m.from_disk * BLOCK if prefix.num_pages > m.device_len else 0
        need = full - prefix.num_pages
        new = cache.alloc_pages(need) if need > 0 else np.empty(0, np.int64)
        if new is None:  # longer than the whole pool: no engine with this pool could run it
            totals["skipped"] += 1
            cache.release(prefix)
            continue
        cache.store(prefix, tokens, new)
        cache.release(prefix)
        ttft.append(time.perf_counter() - t_req)
        # Deterministic: the next request never races this one's copies to host or disk.
        cache.wait_backups()
        if not admin.call("settle", {"timeout_s": 30})["settled"]:
            raise RuntimeError("the daemon's disk writes did not settle within 30 s")
        shown.update(i)
    shown.close()
    cache.poll()
    stats = client.stats()
    cache.close()
    admin.close()
    return {"totals": totals, "ttft": np.array(ttft), "stats": stats, "seconds": time.time() - t0}


SIM_POLICIES = ("OPT", *ONLINE, *HICACHE_POLICIES)


def capacities(args: Any, unique: int) -> list[tuple[str, int]]:
    """(label, capacity in blocks) to simulate: hicache's tiers, then fractions of the unique blocks."""
    out = []
    if not args.sim_only:
        host = parse_size(args.host_capacity) // args.page_bytes
        disk = parse_size(args.disk_capacity) // args.page_bytes
        out.append(("host tier", host))
        if disk:
            out.append(("all tiers", host + disk))
    out += [(f"{f:g} of unique", max(1, int(f * unique))) for f in args.sim_fractions]
    return out


def sim_rows(btrace: BlockTrace, caps: list[tuple[str, int]]) -> tuple[list[dict], dict[str, dict[str, SimResult]]]:
    unique = btrace.unique_blocks()
    inf = simulate_all(btrace, 0, ("infinite",))["infinite"]
    rows = [row("blocks requested", btrace.num_accesses, "blocks"), row("unique blocks", unique, "blocks"),
            row("sim infinite cache: hit rate", inf.hit_rate, "fraction")]
    results: dict[str, dict[str, SimResult]] = {}
    for label, cap in caps:
        res = simulate_all(btrace, cap, SIM_POLICIES)
        results[label] = res
        opt = res["OPT"].hit_rate
        rows.append(row(f"sim @ {label}: capacity", cap, "blocks", share_of_unique=cap / max(1, unique)))
        rows.append(row(f"sim @ {label}: OPT hit rate", opt, "fraction", baseline=inf.hit_rate,
                        baseline_name="infinite"))
        for name in (*ONLINE, *HICACHE_POLICIES):
            rows.append(row(f"sim @ {label}: {name} hit rate", res[name].hit_rate, "fraction", baseline=opt,
                            baseline_name="OPT"))
        rows += policy_goal_rows(label, res)
    return rows, results


def policy_goal_rows(label: str, res: dict[str, SimResult]) -> list[dict]:
    """Each hicache policy against the best online comparison policy and as a share of
    the LRU-to-OPT gap (issue 18's goals: >= best, >= 1/3)."""
    best = max(ONLINE, key=lambda n: res[n].hit_rate)
    opt, lru = res["OPT"].hit_rate, res["LRU"].hit_rate
    rows = []
    for name in HICACHE_POLICIES:
        ours = res[name].hit_rate
        rows.append(row(f"sim @ {label}: {name} vs best online ({best})", ours, "fraction",
                        baseline=res[best].hit_rate, baseline_name=best))
        if opt > lru:
            rows.append(row(f"sim @ {label}: {name} share of the LRU-to-OPT gap", (ours - lru) / (opt - lru),
                            "fraction"))
    return rows


def load_requests(args: Any) -> list[dict]:
    """The `--trace` file, or `--limit` requests (default 4000) of a generated `--workload`."""
    if getattr(args, "workload", None):
        return generate(args.workload, args.limit or 4000, seed=args.seed)
    return load_trace(args.trace, args.limit)


def ablation(args: Any, btrace: BlockTrace, sims: dict[str, dict[str, SimResult]]) -> list[dict]:
    """tiered_sim's ablation rows at `--ablation-fractions`, host:disk split as the daemon's."""
    host = parse_size(args.host_capacity)
    disk = parse_size(args.disk_capacity)
    host_share = host / (host + disk) if host + disk else 1 / 3
    unique = btrace.unique_blocks()
    host_pages = host // args.page_bytes
    device_share = args.device_pages / (args.device_pages + host_pages) if host_pages else 0.5
    rows = []
    for f in args.ablation_fractions:
        total = max(2, int(f * unique))
        label = f"{f:g} of unique"
        res = sims.get(label) or simulate_all(btrace, total, ("OPT", "LRU"))
        opt, lru = res["OPT"].hit_rate, res["LRU"].hit_rate
        h = max(1, round(total * host_share))
        rows += ablation_rows(btrace, label, h, total - h, opt, lru)
        d = min(total - 1, max(1, round(total * device_share)))
        rows += device_host_rows(btrace, label, d, total - d, opt, lru)
        if getattr(args, "signals", False):
            rows += signal_rows(btrace, label, total, opt, lru)
    return rows


def run(args: Any) -> list[dict]:
    trace = load_requests(args)
    btrace = block_trace(trace, BLOCK)
    srows, sims = sim_rows(btrace, capacities(args, btrace.unique_blocks()))
    srows += ablation(args, btrace, sims)
    if args.sim_only:
        return [row("requests", len(trace), "count"), *srows]
    opt_hit, _ = optimum_hit_blocks(trace)
    page_bytes = args.page_bytes
    if args.socket_path is not None:
        res = replay(args.socket_path, trace, args.device_pages, page_bytes)
    else:
        res = replay_fresh(args, trace)
    t = res["totals"]
    prompt = max(1, t["prompt"])
    hit = t["device"] + t["host"] + t["disk"]
    opt_tokens = opt_hit * BLOCK
    rows = [
        row("requests", len(trace), "count"),
        row("prompt tokens", t["prompt"], "tokens"),
        row("hit rate, device", t["device"] / prompt, "fraction"),
        row("hit rate, host", t["host"] / prompt, "fraction"),
        row("hit rate, disk", t["disk"] / prompt, "fraction"),
        row("hit rate, all tiers", hit / prompt, "fraction", baseline=opt_tokens / prompt,
            baseline_name="infinite cache"),
        row("tokens recomputed", t["prompt"] - hit, "tokens", baseline=t["prompt"] - opt_tokens,
            baseline_name="infinite cache"),
        *hicache_vs_sims(t, sims, opt_tokens / prompt),
        *disk_write_rows(res["stats"], t["disk"] // BLOCK, page_bytes),
        row("requests skipped (longer than the device pool)", t["skipped"], "count"),
        row("replay time per request, p50", float(np.median(res["ttft"])) * 1e3 if len(res["ttft"]) else 0, "ms"),
        row("replay wall time", res["seconds"], "s"),
    ]
    if getattr(args, "remote", False):
        rows += remote_rows(args, trace, replay_fresh)
    return rows + srows


def replay_fresh(args: Any, trace: list[dict], env: dict[str, str] | None = None) -> dict[str, Any]:
    """replay() against a daemon started for it (with `env` on top of the bench's own)."""
    flags = ["--host-capacity", args.host_capacity]
    flags += ["--disk-capacity", args.disk_capacity] if parse_size(args.disk_capacity) else ["--no-disk"]
    # A logical index clock: the same trace evicts the same pages in every replay.
    env = {"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_INDEX_CLOCK": "logical",
           "HICACHE_EVICTION_POLICY": args.eviction_policy, "HICACHE_DISK_ADMISSION": args.disk_admission,
           "HICACHE_DISK_PLACEMENT": args.disk_placement, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="hicache-trace-") as tmp:
        daemon = LocalDaemon(tmp, *flags, env=env).start()
        try:
            return replay(daemon.socket, trace, args.device_pages, args.page_bytes)
        finally:
            daemon.stop()


def hicache_vs_sims(t: dict, sims: dict[str, dict[str, SimResult]], infinite: float) -> list[dict]:
    """hicache's hit rate next to OPT and LRU at the same capacity, and its share of the LRU-to-OPT gap."""
    prompt = max(1, t["prompt"])
    rates = {"host tier": (t["device"] + t["host"]) / prompt,
             "all tiers": (t["device"] + t["host"] + t["disk"]) / prompt}
    who = {"host tier": "device + host", "all tiers": "all tiers"}
    rows = []
    for label, res in sims.items():
        if label not in rates:
            continue
        ours, opt, lru = rates[label], res["OPT"].hit_rate, res["LRU"].hit_rate
        rows.append(row(f"hit rate, {who[label]} vs OPT @ {label}", ours, "fraction", baseline=opt,
                        baseline_name="OPT"))
        rows.append(row(f"hit rate, {who[label]} vs LRU @ {label}", ours, "fraction", baseline=lru,
                        baseline_name="LRU"))
        if opt > lru:  # undefined when LRU already reaches the optimum
            rows.append(row(f"share of the LRU-to-OPT gap closed @ {label}", (ours - lru) / (opt - lru),
                            "fraction"))
    return rows


def disk_write_rows(stats: dict, disk_hit_pages: int, page_bytes: int) -> list[dict]:
    """What the disk tier wrote for what it served: admission's measure."""
    disk = stats.get("tiers", {}).get("disk")
    if not disk:
        return []
    written = disk["bytes_written"] // page_bytes
    adm = disk.get("admission") or {}
    return [row("disk pages written", written, "pages", placement=disk.get("placement"), admission=adm.get("mode")),
            row("disk pages written per disk hit", written / max(1, disk_hit_pages), "pages"),
            row("disk admission: pages turned away", adm.get("rejected_pages", 0), "pages")]
