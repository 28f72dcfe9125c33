"""`hicache bench vllm`: a real vLLM engine serving multi-turn conversations through each KV-cache
configuration of `--compare` (hicache/bench/engines/vllm_peers.py: vLLM alone, hicache, LMCache), each
in its own process, in one run.

The workload (hicache/bench/engines/vllm_workload.py) is the same token ids for every configuration,
over the same tiny random Llama (hicache/bench/engines/tiny_llama.py). Two ways to send it:
- turns (default): one `generate` call per turn over all conversations; between turns vLLM's
  own prefix cache is cleared, as device memory pressure would evict it between a user's turns.
- poisson: conversations arrive and speak concurrently through vLLM's AsyncLLM
  (hicache/integrations/vllm_async_driver.py); a small KV cache does the evicting.
- `--concurrency N`: N requests at once into long-lived engines driven step by step, every
  connector call timed, no reuse then reuse, repeats alternating (hicache/bench/engines/vllm_steps.py).

Every run gets the same CPU budget: with a connector configured vLLM's CPU platform reserves
one more core, and on 2 cores gives up and runs the worker on all of them, while vLLM alone
gets one; VLLM_CPU_NUM_OF_RESERVED_CPU=1 for every run makes them equal. Outputs must be equal
to vLLM alone's, request by request, or the bench refuses to compare.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.engines.vllm_peers import BASE, EQUAL_CPUS, OutputsDiffer, PeerRun, bench_setup, \
    lmcache_transfers, parse_compare, start_peer
from hicache.bench.engines.vllm_steps import run as run_steps
from hicache.bench.engines.vllm_workload import conversations, poisson_gaps
from hicache.bench.report import row
from hicache.integrations.vllm_driver import run_in_process
from hicache.progress import Progress

log = logging.getLogger(__name__)

STEP_COUNTER = "vllm:hicache_step_seconds"
# Rates over the copy thread's CPU time: the copy's own speed, without its waits for a core
# (other processes, the daemon) or the GIL, which the wall-time rate includes.
CPU_RATE = ", copy thread's CPU time"


@dataclass
class Measured:
    """One configuration's run, as requests (conversation, turn) plus totals."""

    name: str
    # conversation, turn, outputs, cached, ttft, prompt_tokens; turns mode also queued, prefill (_engine_parts)
    requests: list[dict[str, Any]]
    wall_s: float  # generating everything (turns: the sum of the generate calls)
    warm_wall_s: float | None  # turns mode: turns 2+ only
    init_s: float
    # saved/loaded tokens, save_s, load_s; hicache also save_cpu_s, load_cpu_s (the copy thread's CPU time)
    transfers: dict[str, float] = field(default_factory=dict)
    # seconds engine steps spent inside the connector's calls, per turn (turns mode; hicache only)
    step_s: list[float] | None = None


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)] if s else 0.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def check_outputs_equal(measured: dict[str, Measured], base: str = BASE) -> None:
    """Raise OutputsDiffer unless every configuration generated what `base` did, request by request."""
    want = {(r["conversation"], r["turn"]): r["outputs"] for r in measured[base].requests}
    for name, m in measured.items():
        got = {(r["conversation"], r["turn"]): r["outputs"] for r in m.requests}
        bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        if bad:
            c, t = bad[0]
            raise OutputsDiffer(f"outputs of {name} differ from {base}'s in {len(bad)} of {len(want)} requests "
                                f"(first: conversation {c}, turn {t}): not a valid comparison")


def _transfers(peer: PeerRun, counters: dict[str, float]) -> dict[str, float]:
    if peer.server_log is not None:  # LMCache: its server's log lines
        return lmcache_transfers(peer.server_log)
    if peer.socket is not None:  # hicache: its connector stats, which vLLM aggregates into counters
        return {"saved_tokens": counters.get("vllm:hicache_saved_tokens", 0.0),
                "save_s": counters.get("vllm:hicache_save_seconds", 0.0),
                "loaded_tokens": counters.get("vllm:hicache_loaded_tokens", 0.0),
                "load_s": counters.get("vllm:hicache_load_seconds", 0.0),
                "save_cpu_s": counters.get("vllm:hicache_save_cpu_seconds", 0.0),
                "load_cpu_s": counters.get("vllm:hicache_load_cpu_seconds", 0.0)}
    return {}


def _measure_one(name: str, spec: dict[str, Any], workdir: Path, block_size: int, timeout_s: float) -> Measured:
    with start_peer(name, workdir, block_size) as peer:
        run_spec = {**spec, "connector": peer.connector, "socket": peer.socket}
        try:
            out = run_in_process(run_spec, workdir, name, env=EQUAL_CPUS, timeout_s=timeout_s)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        transfers = _transfers(peer, out["counters"])
    if "requests" in out:  # arrivals mode
        reqs = [{**r, "prompt_tokens": len(spec["conversations"][r["conversation"]][r["turn"]])}
                for r in out["requests"]]
        return Measured(name, reqs, out["wall_s"], None, out["init_s"], transfers)
    reqs = []
    for t, (r, prompts) in enumerate(zip(out["rounds"], spec["rounds"], strict=True)):
        for c, p in enumerate(prompts):
            reqs.append({"conversation": c, "turn": t, "outputs": r["outputs"][c], "cached": r["cached"][c],
                         "ttft": r["ttft"][c], "queued": r["queued"][c], "prefill": r["prefill"][c],
                         "prompt_tokens": len(p)})
    walls = [r["wall_s"] for r in out["rounds"]]
    return Measured(name, reqs, sum(walls), sum(walls[1:]), out["init_s"], transfers, _step_seconds(peer, out))


def _step_seconds(peer: PeerRun, out: dict[str, Any]) -> list[float] | None:
    """hicache: each turn's share of the connector's step-path seconds (its counter after each turn)."""
    if peer.socket is None:
        return None
    totals = [r["counters"].get(STEP_COUNTER, 0.0) for r in out["rounds"]]
    return [b - a for a, b in zip([0.0, *totals], totals)]


def measure(args: argparse.Namespace) -> dict[str, Measured]:
    """Run every configuration of args.compare on one workload; refuse unequal outputs."""
    resolve_defaults(args)
    names, workdir, model = bench_setup(args, "hicache-bench-vllm-")
    rounds = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                           args.reply_tokens)
    poisson = args.arrivals == "poisson"
    spec: dict[str, Any] = {"model": str(model), "block_size": args.block_size, "max_tokens": args.max_tokens,
                            "max_model_len": args.max_model_len, "kv_cache_bytes": args.kv_cache_mib << 20}
    if poisson:
        spec["arrivals"] = "poisson"
        spec["conversations"] = [[rounds[t][c] for t in range(args.turns)] for c in range(args.conversations)]
        spec["gaps"] = poisson_gaps(args.conversations, args.turns, args.rate, seed=args.seed)
    else:
        spec["rounds"] = rounds
    shown = Progress("bench vllm", total=len(names), unit="configurations")
    measured = {}
    for i, name in enumerate(names):
        shown.update(i, note=f"running {name} (a vLLM process)")
        measured[name] = _measure_one(name, spec, workdir, args.block_size, args.timeout_s)
    shown.update(len(names))
    shown.close()
    try:
        check_outputs_equal(measured)
    except OutputsDiffer as e:
        raise SystemExit(str(e)) from None
    return measured


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """K and V of every layer, fp32."""
    return 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 4


def _metrics(m: Measured, bytes_per_token: int, poisson: bool) -> dict[str, tuple[float | None, str]]:
    """metric -> (value, unit); None where the configuration does not expose it."""
    out: dict[str, tuple[float | None, str]] = {}
    for label, warm in (("cold (turn 1)", False), ("warm (turns 2+)", True)):
        reqs = [r for r in m.requests if (r["turn"] > 0) == warm]
        ttfts = [r["ttft"] * 1e3 for r in reqs if r["ttft"] is not None]
        out[f"ttft mean, {label}"] = (_mean(ttfts), "ms")
        out[f"ttft p90, {label}"] = (_p90(ttfts), "ms")
        # Where the TTFT went (turns mode), from vLLM's engine-core timestamps: in the scheduler's
        # queue (behind other requests' steps, or a connector's lookup asked again), then scheduled
        # to first token (the prefill steps and the loads in them); the rest is getting into the
        # engine core, which reads new requests only between steps.
        for part, key in (("queued in the engine", "queued"), ("scheduled to first token", "prefill")):
            xs = [r[key] * 1e3 for r in reqs if r.get(key) is not None]
            if xs:
                out[f"ttft part mean, {part}, {label}"] = (_mean(xs), "ms")
        out[f"prefill tokens computed, {label}"] = (float(sum(r["prompt_tokens"] - r["cached"] for r in reqs)),
                                                    "tokens")
    tr = m.transfers
    for kind in ("save", "load"):
        tokens = tr.get("saved_tokens" if kind == "save" else "loaded_tokens")
        for suffix, seconds in (("", tr.get(f"{kind}_s")), (CPU_RATE, tr.get(f"{kind}_cpu_s"))):
            rate = tokens * bytes_per_token / seconds / 1e9 if tokens and seconds else None
            if rate is not None or not suffix:  # the CPU-time rate only where a peer reports it
                out[f"{kind} GB/s{suffix}"] = (rate, "GB/s")
    if m.step_s is not None:  # what the connector's calls added to the engine's steps
        out["connector time in steps, cold (turn 1)"] = (m.step_s[0] * 1e3, "ms")
        out["connector time in steps, warm (turns 2+)"] = (sum(m.step_s[1:]) * 1e3, "ms")
    elif not poisson:  # vLLM alone, and peers that do not report it
        out["connector time in steps, cold (turn 1)"] = (None, "ms")
        out["connector time in steps, warm (turns 2+)"] = (None, "ms")
    out["generate wall, all turns"] = (m.wall_s, "s")
    if m.warm_wall_s is not None:
        out["generate wall, warm turns"] = (m.warm_wall_s, "s")
    if poisson:
        out["throughput"] = (len(m.requests) / m.wall_s, "req/s")
        out["output throughput"] = (sum(len(r["outputs"]) for r in m.requests) / m.wall_s, "tok/s")
    out["engine start"] = (m.init_s, "s")
    return out


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """A memcpy-class copy on this machine: one thread, both buffers already faulted in,
    the median of `repeats` copies of `nbytes` (the bar the connector's copies are held to)."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def rows(measured: dict[str, Measured], bytes_per_token: int, poisson: bool,
         memcpy: float | None = None) -> list[dict]:
    """One row per metric and configuration: the ratio to vLLM alone, and in the note to each
    peer; with `memcpy` (GB/s), each configuration's save and load rates against it."""
    metrics = {n: _metrics(m, bytes_per_token, poisson) for n, m in measured.items()}
    out = []
    for metric, (_, unit) in metrics[BASE].items():
        base = metrics[BASE][metric][0]
        for name, ms in metrics.items():
            value = ms.get(metric, (None,))[0]  # a part only some runs' vLLM timestamped
            if value is None:  # vLLM alone moves nothing; a peer may not say what it moved
                if name != BASE:
                    out.append(row(f"{metric} [{name}]", float("nan"), unit, note="not exposed"))
                continue
            peers = [f"{value / ms2[metric][0]:.2f}x {n2}" for n2, ms2 in metrics.items()
                     if n2 not in (BASE, name) and ms2.get(metric, (None,))[0]]
            note = ("vs " + ", ".join(peers)) if peers and name != BASE else None
            if name == BASE or base is None:
                out.append(row(f"{metric} [{name}]", value, unit, note=note))
            else:
                out.append(row(f"{metric} [{name}]", value, unit, base, "vLLM alone", note=note))
    cold_ttft = metrics[BASE]["ttft mean, cold (turn 1)"][0]
    for name, m in measured.items():
        if m.step_s and cold_ttft:  # no request's TTFT grows by more than the turn's step time
            out.append(row(f"connector time in steps / cold TTFT of vLLM alone [{name}]", m.step_s[0] * 1e3 / cold_ttft,
                           "ratio", note="bounds what the connector's calls add to a turn-1 request"))
    if memcpy:
        out.append(row("memcpy GB/s (one thread, pre-faulted, 64 MiB)", memcpy, "GB/s"))
        for name, ms in metrics.items():
            for kind in ("save", "load"):
                for suffix in ("", CPU_RATE):
                    value = ms.get(f"{kind} GB/s{suffix}", (None,))[0]
                    if value is not None:
                        out.append(row(f"{kind} GB/s{suffix} vs memcpy [{name}]", value, "GB/s", memcpy, "memcpy"))
    return out


# Defaults that depend on the mode: the turns and poisson modes' model and requests, and the
# concurrent mode's (a model whose steps take on this CPU what a real one's take on a GPU).
MODE_DEFAULTS = {
    "turns": {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "max_tokens": 4, "kv_cache_mib": 256},
    "poisson": {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "max_tokens": 4, "kv_cache_mib": 64},
    "concurrency": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 1, "max_tokens": 32, "kv_cache_mib": 256,
                    "max_num_batched_tokens": 1024},
}


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset with the defaults of the mode they run in."""
    mode = "concurrency" if getattr(args, "concurrency", None) is not None else args.arrivals
    for key, value in MODE_DEFAULTS[mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> list[dict]:
    resolve_defaults(args)
    if args.concurrency is not None:
        if args.arrivals != "turns" or getattr(args, "plot", None):
            raise SystemExit("--concurrency is a mode of its own: without --arrivals and --plot")
        return run_steps(args)
    measured = measure(args)
    return rows(measured, kv_bytes_per_token(args), args.arrivals == "poisson", memcpy_gbps())


def _compare(text: str) -> list[str]:
    try:
        return parse_compare(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _prompt_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token range: {text!r} (e.g. 512-1536)") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"a token range goes up from 1: {text!r}")
    return a, b


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--compare", type=_compare, default=["none", "hicache"],
                   help="configurations, comma-separated: none (vLLM alone, always run), hicache, hicache-host (no disk tier), lmcache, "
                        "lmcache-fs, lmcache-chunk256 (LMCache: bash scripts/install_lmcache.sh); with --concurrency a "
                        "hicache daemon may be placed: hicache:cpus=1, hicache:nice=-10, hicache:weight=1000 (combined "
                        "with ':'; each its own daemon)")
    b.add_argument("--arrivals", choices=["turns", "poisson"], default="turns",
                   help="turns: one generate call per turn, vLLM's prefix cache cleared between turns; "
                        "poisson: concurrent conversations through AsyncLLM at --rate requests/s")
    b.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="the concurrent mode: N requests at once into a long-lived engine per configuration, driven "
                        "step by step, every connector call timed; no reuse, then reuse after vLLM's prefix cache "
                        "is reset; alternating --repeats (issue 41's setup: --concurrency 96)")
    b.add_argument("--repeats", type=int, default=5, help="--concurrency: repeats, the configurations' order rotating")
    b.add_argument("--prefixes", type=int, default=4, help="--concurrency: shared prefixes among the prompts")
    b.add_argument("--prefix-tokens", type=int, default=384, help="--concurrency: each shared prefix's length")
    b.add_argument("--prompt-tokens", type=_prompt_range, default=(512, 1536), metavar="MIN-MAX",
                   help="--concurrency: prompt lengths, uniform (a prefix + a suffix of its own)")
    b.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="--concurrency: vLLM's token budget per step (default 1024)")
    b.add_argument("--hogs", type=int, default=0,
                   help="--concurrency: CPU-bound processes running beside everything for the whole run")
    b.add_argument("--rate", type=float, default=2.0, help="poisson: requests/s over all conversations")
    b.add_argument("--seed", type=int, default=0, help="poisson: the arrival gaps' seed; --concurrency: the prompts' "
                                                       "(repeat r draws with seed + r)")
    b.add_argument("--conversations", type=int, default=8)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--system-tokens", type=int, default=1024)
    b.add_argument("--user-tokens", type=int, default=96)
    b.add_argument("--reply-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 4; --concurrency: 32)")
    b.add_argument("--max-model-len", type=int, default=2048)
    b.add_argument("--kv-cache-mib", type=int, default=None,
                   help="vLLM's KV cache (default 256; poisson: 64, so conversations are evicted between turns)")
    b.add_argument("--block-size", type=int, default=32)
    b.add_argument("--layers", type=int, default=None, help="the random Llama (default 8 layers, hidden 512, "
                                                             "8 heads, 4 KV heads; --concurrency: 2, 128, 4, 1)")
    b.add_argument("--hidden", type=int, default=None)
    b.add_argument("--heads", type=int, default=None)
    b.add_argument("--kv-heads", type=int, default=None)
    b.add_argument("--timeout-s", type=float, default=1800.0,
                   help="per vLLM process (--concurrency: per engine start and per phase)")
    b.add_argument("--workdir")
