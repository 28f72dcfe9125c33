"""`hicache bench trace`: replay a Mooncake-format trace against a real daemon.

Each request's 512-token blocks are mapped to deterministic token runs (block
id -> seeded tokens), so equal block ids are equal prefixes. One engine with a
deliberately small device pool serves the requests in order through the real
client (match, per-layer load of the host part, insert with write-through
backups, eviction under pressure); its pages are small (`--page-bytes`) so the
replay measures the cache policy, not the copy speed. Reported: the share of
prompt tokens served per tier and the tokens recomputed, next to the
infinite-cache optimum of the same trace (a block hits iff every block before
it in the request was seen earlier in the trace).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

import numpy as np

from hicache.bench.report import row
from hicache.client.client import HiCacheClient
from hicache.client.engine_cache import EngineCache
from hicache.config import parse_size
from hicache.daemon.launcher import LocalDaemon
from hicache.layout import KVLayout
from hicache.tiers.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device import DevicePool

BLOCK = 512


def block_tokens(block_id: int) -> np.ndarray:
    return np.random.default_rng(block_id).integers(0, 1 << 20, BLOCK, dtype=np.int32)


def load_trace(path: str, limit: int | None) -> list[dict]:
    out = []
    with open(path) as f:
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


def _progress(i: int, n: int, t0: float) -> None:
    if sys.stderr.isatty() and (i % 100 == 0 or i == n):
        rate = i / max(time.time() - t0, 1e-9)
        sys.stderr.write(f"\r  trace {i}/{n} requests ({rate:.0f}/s)")
        if i == n:
            sys.stderr.write("\n")
        sys.stderr.flush()


def replay(sock: str, trace: list[dict], device_pages: int, page_bytes: int) -> dict[str, Any]:
    head_dim = max(1, page_bytes // (BLOCK * 2 * 2))  # one layer, one head, fp16 K and V
    layout = KVLayout("mha", num_layers=1, page_size=BLOCK, dtype="float16", num_kv_heads=1, head_dim=head_dim)
    pool = DevicePool(layout, device_pages * BLOCK)
    alloc = PagedTokenToKVPoolAllocator(pool.num_slots, BLOCK)
    client = HiCacheClient(layout, device_pages, model="trace-replay", socket_path=sock, timeout_s=30)
    cache = EngineCache(client, pool, alloc)
    blocks: dict[int, np.ndarray] = {}
    totals = {"prompt": 0, "full_block_tokens": 0, "device": 0, "host": 0, "disk": 0, "skipped": 0}
    ttft: list[float] = []
    t0 = time.time()
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
        if new is None:  # the pool cannot hold this request even after eviction
            totals["skipped"] += 1
            cache.release(prefix)
            continue
        ttft.append(time.perf_counter() - t_req)
        cache.store(prefix, tokens, new)
        cache.release(prefix)
        _progress(i, len(trace), t0)
    cache.poll()
    stats = client.stats()
    cache.close()
    return {"totals": totals, "ttft": np.array(ttft), "stats": stats, "seconds": time.time() - t0}


def run(args: Any) -> list[dict]:
    trace = load_trace(args.trace, args.limit)
    opt_hit, opt_total = optimum_hit_blocks(trace)
    page_bytes = args.page_bytes
    with tempfile.TemporaryDirectory(prefix="hicache-trace-") as tmp:
        daemon = None
        sock = args.socket_path
        if sock is None:
            flags = ["--host-capacity", args.host_capacity]
            flags += ["--disk-capacity", args.disk_capacity] if parse_size(args.disk_capacity) else ["--no-disk"]
            daemon = LocalDaemon(tmp, *flags, env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
            sock = daemon.socket
        try:
            res = replay(sock, trace, args.device_pages, page_bytes)
        finally:
            if daemon is not None:
                daemon.stop()
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
        row("requests skipped (pool too small)", t["skipped"], "count"),
        row("replay time per request, p50", float(np.median(res["ttft"])) * 1e3 if len(res["ttft"]) else 0, "ms"),
        row("replay wall time", res["seconds"], "s"),
    ]
    return rows
