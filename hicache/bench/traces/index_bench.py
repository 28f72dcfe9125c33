"""Radix index replay of the Mooncake conversation trace.

Each 512-token block id of the trace maps to a deterministic run of tokens
(block b -> b*512 .. b*512+511, mod 2**31-1, so distinct blocks never share a
run); a request's prompt is its blocks concatenated and cut to input_length
(the last block partial, and a trailing partial page has no key). Per request:
the chained page keys of its full pages, match(keys, engine 0), insert(keys,
tokens, device pages) -- the index work the daemon does per prefill.

Scenarios:
- unbounded: every page stays resident on engine 0's device.
- bounded: engine 0 has a device budget of `capacity_pages`; per request the
  matched prefix is locked, evict() makes room for the new pages, insert, unlock.

Baseline, timed in the same pass on the same keys: a flat dict from page key to
page id (look the prefix up page by page, store the missing pages), i.e. a
per-block hash map without tiers, locks, eviction order, node splits -- and
without keeping the tokens, which the index copies for every new page
(page_size * 4 bytes; on a growing tree that copy, mostly page faults on fresh
memory, is the larger part of insert time). Timings exclude building the token
arrays; key hashing is timed on its own. *_cpu_* rows use thread CPU time, so
their tail is free of preemption on a busy machine.

    python -m hicache.bench.traces.index_bench   # the shipped Mooncake trace; --trace FILE for another
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hicache.bench.traces.trace_files import DEFAULT_TRACE, open_trace
from hicache.index.keys import page_keys
from hicache.index.radix import RadixIndex, Tier

TRACE_BLOCK = 512           # tokens per hash id in the Mooncake trace
_MOD = 2**31 - 1
_SALT = b"index-bench-salt"


def _requests(trace_path: str, limit: int | None) -> list[tuple[list[int], int]]:
    out = []
    with open_trace(trace_path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append((row["hash_ids"], int(row["input_length"])))
    return out


def _tokens(hash_ids: list[int], input_length: int) -> np.ndarray:
    blocks = np.asarray(hash_ids, dtype=np.int64)[:, None] * TRACE_BLOCK + np.arange(TRACE_BLOCK)
    return (blocks.ravel()[:input_length] % _MOD).astype(np.int32)


class _FreeStack:
    """Device page ids 1..capacity (0 is padding), as the daemon's allocator would hand them out."""

    def __init__(self, capacity: int) -> None:
        self.ids = np.arange(1, capacity + 1, dtype=np.int64)
        self.top = capacity

    def pop(self, n: int) -> np.ndarray:
        self.top -= n
        return self.ids[self.top:self.top + n].copy()

    def push(self, ids: np.ndarray) -> None:
        self.ids[self.top:self.top + len(ids)] = ids
        self.top += len(ids)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def run(trace_path: str, page_size: int = 512, limit: int | None = None,
        capacity_pages: int | None = None) -> list[dict]:
    """Replay the trace; return rows {"name", "value", "unit"} (some with "baseline").
    capacity_pages None: the unbounded scenario; else the bounded one with that budget."""
    reqs = _requests(trace_path, limit)
    bounded = capacity_pages is not None
    idx = RadixIndex(page_size, _SALT)
    free = _FreeStack(capacity_pages) if bounded else None
    next_id = 1
    flat: dict[bytes, int] = {}
    t_hash = t_index = t_flat = 0.0
    lat: list[float] = []
    cpu: list[float] = []  # thread CPU time: the tail without preemption by other processes
    pages = hits = flat_hits = evicted = 0
    perf = time.perf_counter
    cpu_time = time.thread_time
    for hash_ids, input_length in reqs:
        tokens = _tokens(hash_ids, input_length)
        t0 = perf()
        keys = page_keys(_SALT, tokens, page_size)
        t1 = perf()
        t_hash += t1 - t0
        n = len(keys)
        toks = tokens[:n * page_size]
        pages += n

        c0 = cpu_time()
        t0 = perf()
        m = idx.match(keys, 0)
        dl = m.device_len
        if not bounded:
            new = np.arange(next_id, next_id + n - dl, dtype=np.int64)
            next_id += n - dl
            idx.insert(keys, toks, engine=0, device_pages=np.concatenate([m.device_pages, new]))
        else:
            if dl:
                idx.lock(m.device_nodes[-1], Tier.DEVICE, 0)
            need = n - dl
            if free.top < need:
                for f in idx.evict(Tier.DEVICE, need - free.top, 0):
                    free.push(f.slots)
                    evicted += len(f.slots)
            fit = min(need, free.top)  # a prompt larger than the budget keeps what fits
            if fit:
                r = idx.insert(keys[:dl + fit], toks[:(dl + fit) * page_size], engine=0,
                               device_pages=np.concatenate([m.device_pages, free.pop(fit)]))
                if len(r.dup_device_pages):
                    free.push(r.dup_device_pages)
            if dl:
                idx.unlock(m.device_nodes[-1], Tier.DEVICE, 0)
        t1 = perf()
        cpu.append(cpu_time() - c0)
        t_index += t1 - t0
        lat.append(t1 - t0)
        hits += dl

        if not bounded:  # the flat baseline has no eviction: compare where both keep everything
            t0 = perf()
            i = 0
            for i, k in enumerate(keys):  # noqa: B007 -- i is the hit count after the loop
                if k not in flat:
                    break
            else:
                i = n
            flat_hits += i
            flat.update(zip(keys[i:], range(next_id, next_id + n - i)))
            t_flat += perf() - t0

    label = "unbounded" if not bounded else f"bounded_{capacity_pages}"
    rows = [
        {"name": f"{label}.requests", "value": len(reqs), "unit": "req"},
        {"name": f"{label}.pages", "value": pages, "unit": "pages"},
        {"name": f"{label}.hash", "value": pages / t_hash, "unit": "pages/s"},
        {"name": f"{label}.match_insert", "value": pages / t_index, "unit": "pages/s"},
        {"name": f"{label}.hash_match_insert", "value": pages / (t_hash + t_index), "unit": "pages/s"},
        {"name": f"{label}.match_insert_p50", "value": _pct(lat, 50) * 1e6, "unit": "us/req"},
        {"name": f"{label}.match_insert_p99", "value": _pct(lat, 99) * 1e6, "unit": "us/req"},
        {"name": f"{label}.match_insert_cpu_p50", "value": _pct(cpu, 50) * 1e6, "unit": "us/req"},
        {"name": f"{label}.match_insert_cpu_p99", "value": _pct(cpu, 99) * 1e6, "unit": "us/req"},
        {"name": f"{label}.page_hit_rate", "value": hits / max(pages, 1), "unit": "ratio"},
        {"name": f"{label}.nodes", "value": sum(1 for _ in idx.iter_nodes()), "unit": "nodes"},
        {"name": f"{label}.device_pages", "value": idx.num_pages(Tier.DEVICE, 0), "unit": "pages"},
    ]
    if bounded:
        rows.append({"name": f"{label}.evicted", "value": evicted, "unit": "pages"})
    else:
        assert flat_hits == hits, "the index and the flat map disagree on hits"
        rows[3]["baseline"] = pages / t_flat
        rows[3]["baseline_name"] = "flat dict"
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--page-size", type=int, default=512)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--capacity", type=int, default=32768,
                    help="device budget (pages) of the bounded scenario; 0 skips it")
    ap.add_argument("--json", action="store_true", help="print rows as JSON lines")
    args = ap.parse_args(argv)
    rows = run(args.trace, args.page_size, args.limit)
    if args.capacity:
        rows += run(args.trace, args.page_size, args.limit, capacity_pages=args.capacity)
    for r in rows:
        if args.json:
            print(json.dumps(r))
            continue
        line = f"{r['name']:34s} {r['value']:14,.2f} {r['unit']}"
        if "baseline" in r:
            line += f"   ({r['baseline_name']}: {r['baseline']:,.0f} {r['unit']}, " \
                    f"ratio {r['value'] / r['baseline']:.2f})"
        print(line)


if __name__ == "__main__":
    main()
