"""`hicache bench multiturn`: the reference engine serving multi-turn conversations.

Each conversation starts with a shared system prompt; turn t's prompt is
everything so far plus new user tokens, and the engine generates a few tokens
per turn. Conversations are served in rounds (every conversation's turn 1,
then every turn 2, ...), in a shuffled order each round, as users answer at
different speeds: between two turns of one conversation anywhere from none to
almost twice all the others run, pushing its pages out of a deliberately
small device pool, then out of the host tier. (Without the shuffle every reuse
distance would be the same, and an LRU host tier smaller than the workload
would hold none of what comes back.) Four setups serve the same workload:

  no cache          the engine computes every prompt token;
  device            a device-only prefix cache: the daemon tracks the engine's
                    own pages but never backs them up (write_through_selective
                    with an unreachable hit threshold, no disk), so evicted
                    pages are gone - what an engine's built-in radix cache does;
  device+host       write-through to a host tier holding about half of the
                    workload's KV, no disk;
  device+host+disk  the same host tier with a disk tier behind it.

The four run in lockstep (request i of each setup, then request i+1), so load
from other processes on the machine falls on all of them alike. Reported per
setup: prefill tokens computed, the share of prompt tokens reused per tier,
time to first token (lookup + load + prefill), each next to no cache, and the
daemon round trips per request: the calls the engine waited on, by method, and
apart from them the calls it posted (sent without waiting).
Next to them, the infinite cache (`infinite_prefill`): the prefill any page-granular prefix cache must
compute on the same prompts and outputs; each setup's prefill is shown as a ratio to it.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.engines.demo import Conversation, Workload
from hicache.bench.report import row
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.engine.cached import CachedEngine, Generation
from hicache.engine.model import ModelConfig, TinyTransformer

PAGE_SIZE = 16
# Two layers keep the run short on a CPU; four KV heads of 32 make a page 32 KiB,
# so the host tier (1 MiB slabs) can be sized to a fraction of the workload.
MODEL = ModelConfig(num_layers=2, hidden=64, num_heads=4, num_kv_heads=4, head_dim=32, intermediate=128)
WORKLOAD = Workload(system_tokens=128, user_tokens=32, new_tokens=8)
HOST_SHARE = 0.5  # of the workload's KV bytes
MIB = 1 << 20
NEVER = str(2**31 - 1)  # a hit count no page reaches: the daemon never backs pages up


@dataclass(slots=True)
class Setup:
    name: str
    flags: tuple[str, ...] | None  # None: no daemon, no cache
    env: dict[str, str] = field(default_factory=dict)
    engine: CachedEngine | None = None
    daemon: LocalDaemon | None = None
    convs: list[Conversation] = field(default_factory=list)
    gens: list[Generation] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)


def setups(host_capacity: str) -> list[Setup]:
    wait = {"HICACHE_LOAD_POLICY": "wait_complete"}
    return [
        Setup("no cache", None),
        Setup("device", ("--no-disk", "--host-capacity", "1MiB", "--write-policy", "write_through_selective"),
              {"HICACHE_WRITE_HIT_THRESHOLD": NEVER}),
        Setup("device+host", ("--no-disk", "--host-capacity", host_capacity), wait),
        Setup("device+host+disk", ("--host-capacity", host_capacity, "--disk-capacity", "1GiB"), wait),
    ]


def sizes(conversations: int, turns: int, page_bytes: int) -> tuple[int, int, int]:
    """(device pool pages, host tier MiB, workload KV bytes).

    The device pool holds two of the largest requests; the host tier about half
    the workload, and always more than the device pool: write-through makes it
    a superset of what is on device, so a smaller one would add nothing.
    """
    w = WORKLOAD
    final_tokens = w.system_tokens + turns * (w.user_tokens + w.new_tokens)
    system_pages = w.system_tokens // PAGE_SIZE
    own_pages = final_tokens // PAGE_SIZE - system_pages
    kv_bytes = (system_pages + conversations * own_pages) * page_bytes
    device_pages = 2 * math.ceil(final_tokens / PAGE_SIZE)
    host_mib = max(math.ceil(device_pages * page_bytes / MIB) + 1, round(HOST_SHARE * kv_bytes / MIB))
    return device_pages, host_mib, kv_bytes


def infinite_prefill(prompts: list[list[int]], outputs: list[list[int]], page_size: int) -> list[int]:
    """Prompt tokens each request must compute with an infinite prefix cache, in the engine's rules:
    the lookup covers `prompt[:-1]` in whole pages, and a request leaves behind the full pages of
    its prompt plus all but the last generated token (the tokens whose KV it computed)."""
    seen: set[bytes] = set()
    out = []
    for prompt, gen in zip(prompts, outputs):
        p = np.asarray(prompt, dtype=np.int32)
        k = 0
        while (k + 1) * page_size <= len(p) - 1 and p[:(k + 1) * page_size].tobytes() in seen:
            k += 1
        out.append(len(p) - k * page_size)
        kept = np.asarray([*prompt, *gen[:-1]], dtype=np.int32)
        seen.update(kept[:(j + 1) * page_size].tobytes() for j in range(len(kept) // page_size))
    return out


def _progress(i: int, n: int, t0: float) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r  multiturn {i}/{n} requests per setup, {time.time() - t0:.0f}s")
        if i == n:
            sys.stderr.write("\n")
        sys.stderr.flush()


def serve(conversations: int, turns: int) -> tuple[list[Setup], dict[str, Any]]:
    model = TinyTransformer(MODEL)
    page_bytes = model.layout(PAGE_SIZE).page_bytes
    device_pages, host_mib, kv_bytes = sizes(conversations, turns, page_bytes)
    all_setups = setups(f"{host_mib}MiB")
    rng = np.random.default_rng(WORKLOAD.seed)
    schedule = [(t, int(c)) for t in range(turns) for c in rng.permutation(conversations)]
    with tempfile.TemporaryDirectory(prefix="hicache-multiturn-") as tmp:
        try:
            for i, s in enumerate(all_setups):
                if s.flags is not None:
                    s.daemon = LocalDaemon(Path(tmp) / str(i), *s.flags, env=s.env).start()
                s.engine = CachedEngine.create(model, page_size=PAGE_SIZE, device_pages=device_pages,
                                               socket_path=s.daemon.socket if s.daemon else None,
                                               use_cache=s.daemon is not None, timeout_s=30.0)
                s.convs = [Conversation(c, WORKLOAD) for c in range(conversations)]
            t0 = time.time()
            for i, (_, c) in enumerate(schedule, 1):
                for s in all_setups:
                    prompt = s.convs[c].next_prompt()
                    g = s.engine.generate(prompt, WORKLOAD.new_tokens)
                    if g is None:
                        raise RuntimeError(f"{s.name}: a request did not fit the device pool")
                    s.gens.append(g)
                    s.prompts.append(prompt)
                    s.convs[c].answer(prompt, g.output_ids)
                _progress(i, len(schedule), t0)
            seconds = time.time() - t0
        finally:
            for s in all_setups:
                if s.engine is not None:
                    s.engine.close()
                if s.daemon is not None:
                    s.daemon.stop()
    info = {"device_pages": device_pages, "host_mib": host_mib, "kv_bytes": kv_bytes, "seconds": seconds,
            "page_bytes": page_bytes}
    return all_setups, info


def _per_request(counts: dict[str, int], requests: int) -> dict[str, float]:
    return {m: round(n / max(1, requests), 2) for m, n in sorted(counts.items())}


def _calls_note(waited: dict[str, float], posted: dict[str, float]) -> str:
    """Which calls the engine waited on (its round trips) and which it only sent."""
    def fmt(d: dict[str, float]) -> str:
        return ", ".join(f"{m} {n:g}" for m, n in d.items()) or "none"
    return f"waited: {fmt(waited)}; posted: {fmt(posted)}"


def run(args: Any) -> list[dict]:
    if args.conversations < 1 or args.turns < 1:
        raise SystemExit("--conversations and --turns must be >= 1")
    all_setups, info = serve(args.conversations, args.turns)
    base = all_setups[0]
    base_computed = sum(g.computed_tokens for g in base.gens)
    base_ttft = np.array([g.ttft_s for g in base.gens]) * 1e3
    prompt_tokens = sum(g.prompt_tokens for g in base.gens)
    bound = sum(infinite_prefill(base.prompts, [g.output_ids for g in base.gens], PAGE_SIZE))
    rows = [
        row("requests per setup", len(base.gens), "count"),
        row("prompt tokens per setup", prompt_tokens, "tokens"),
        row("workload KV", info["kv_bytes"] / MIB, "MiB"),
        row("device pool", info["device_pages"] * info["page_bytes"] / MIB, "MiB",
            pages=info["device_pages"]),
        row("host tier", info["host_mib"], "MiB"),
        row("infinite cache: prefill tokens computed", bound, "tokens", baseline=base_computed,
            baseline_name="no cache"),
    ]
    for s in all_setups:
        computed = sum(g.computed_tokens for g in s.gens)
        ttft = np.array([g.ttft_s for g in s.gens]) * 1e3
        rows.append(row(f"{s.name}: prefill tokens computed", computed, "tokens", baseline=base_computed,
                        baseline_name="no cache"))
        rows.append(row(f"{s.name}: prefill tokens computed vs infinite cache", computed, "tokens", baseline=bound,
                        baseline_name="infinite cache"))
        if s is not base:
            for tier in ("device", "host", "disk"):
                reused = sum(getattr(g, f"{tier}_tokens") for g in s.gens)
                rows.append(row(f"{s.name}: prompt tokens from {tier}", reused / max(1, prompt_tokens), "fraction"))
        rows.append(row(f"{s.name}: TTFT mean", float(ttft.mean()), "ms", baseline=float(base_ttft.mean()),
                        baseline_name="no cache"))
        rows.append(row(f"{s.name}: TTFT p50", float(np.median(ttft)), "ms", baseline=float(np.median(base_ttft)),
                        baseline_name="no cache"))
        if s is not base:
            c = s.engine.cache.client  # type: ignore[union-attr]
            waited, posted = _per_request(c.calls, len(s.gens)), _per_request(c.posted_calls, len(s.gens))
            rows.append(row(f"{s.name}: daemon round trips per request", c.round_trips / len(s.gens), "calls",
                            posted=round(c.posted / len(s.gens), 2), by_method=waited, posted_by_method=posted,
                            note=_calls_note(waited, posted)))
            same = sum(g.output_ids == b.output_ids for g, b in zip(s.gens, base.gens))
            rows.append(row(f"{s.name}: outputs equal to no cache", same / max(1, len(s.gens)), "fraction"))
    rows.append(row("wall time (4 setups in lockstep)", info["seconds"], "s"))
    return rows
