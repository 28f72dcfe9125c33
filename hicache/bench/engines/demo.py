"""`hicache demo`: a daemon with embedded defaults and a short multi-turn workload through it.

Two reference engines (each with its own small device pool) serve conversations
that share a system prompt; each turn goes to the other engine, as a load
balancer without session affinity would send it, so a turn's context is on the
other engine's device and comes back through the host tier. Then the daemon is
restarted: the host tier starts empty, the disk tier keeps its pages, and a
third engine serves the last turn of every conversation from disk. The summary
shows the daemon's per-tier hit rates and the prefill work saved.

`Conversation` (the multi-turn workload) is shared with `hicache bench
multiturn` and the engine tests; the daemon runs as a child process through
`hicache.daemon.serve.launcher.LocalDaemon`.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hicache.config import format_size, parse_size
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.errors import ConfigError, HiCacheError

if TYPE_CHECKING:
    from hicache.engine.cached import EngineStats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workload:
    system_tokens: int = 64  # a system prompt every conversation starts with
    user_tokens: int = 32  # new user tokens per turn
    new_tokens: int = 8  # tokens generated per turn
    vocab_size: int = 512
    seed: int = 0


class Conversation:
    """Turn t's prompt = everything so far (system prompt, earlier turns and answers) + new user tokens."""

    def __init__(self, index: int, workload: Workload) -> None:
        self.index = index
        self.workload = workload
        self.context = self._tokens((0,), workload.system_tokens)
        self.turns = 0

    def _tokens(self, key: tuple[int, ...], n: int) -> list[int]:
        rng = np.random.default_rng([self.workload.seed, *key])
        return rng.integers(0, self.workload.vocab_size, n).tolist()

    def next_prompt(self) -> list[int]:
        return self.context + self._tokens((1, self.index, self.turns), self.workload.user_tokens)

    def answer(self, prompt: list[int], output_ids: list[int]) -> None:
        self.context = prompt + list(output_ids)
        self.turns += 1


# -- the demo -------------------------------------------------------------------------------
PAGE_SIZE = 16
POOL_PAGES = 48
TURNS = 4


def run_demo(args: argparse.Namespace) -> int:
    from hicache.engine.cached import CachedEngine, EngineStats  # torch loads only here
    from hicache.engine.model import ModelConfig, TinyTransformer

    if args.requests < 1:
        raise ConfigError("--requests must be >= 1")
    if not getattr(args, "verbose", False):  # connection notices would interleave with the summary
        logging.getLogger("hicache.client").setLevel(logging.WARNING)
    disk_on = parse_size(args.disk_capacity) > 0
    parse_size(args.host_capacity)
    turns = min(TURNS, args.requests)
    conversations = math.ceil(args.requests / turns)
    schedule = [(t, c) for t in range(turns) for c in range(conversations)][:args.requests]
    flags = ["--host-capacity", str(args.host_capacity)]
    flags += ["--disk-capacity", str(args.disk_capacity)] if disk_on else ["--no-disk"]
    workload = Workload()
    config = ModelConfig(num_layers=2, hidden=64, head_dim=16, intermediate=128)
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as tmp:
        # The disk part must arrive before the load plan is made, or the demo would show misses.
        daemon = LocalDaemon(tmp, *flags, env={"HICACHE_LOAD_POLICY": "wait_complete"})
        daemon.start()
        opened: list[CachedEngine] = []

        def close_engines() -> None:
            while opened:
                opened.pop().close()

        try:
            first = _daemon_stats(daemon)
            print("hicache demo")
            print(f"  daemon    pid {daemon.proc.pid}, host tier {format_size(first['tiers']['host']['capacity_bytes'])}"
                  + (f", disk tier {format_size(first['tiers']['disk']['capacity_bytes'])}" if disk_on else
                     ", no disk tier"))
            print(f"  engines   2 reference engines (tiny MHA transformer, {config.num_layers} layers), "
                  f"{POOL_PAGES}-page device pools of {PAGE_SIZE} tokens")
            print(f"  workload  {conversations} conversations x {turns} turns sharing a "
                  f"{workload.system_tokens}-token system prompt: {len(schedule)} requests")
            model = TinyTransformer(config)
            convs = [Conversation(c, workload) for c in range(conversations)]
            totals = EngineStats()
            daemon_runs: list[dict] = []

            def new_engine() -> CachedEngine:
                opened.append(CachedEngine.create(model, page_size=PAGE_SIZE, device_pages=POOL_PAGES,
                                                  socket_path=daemon.socket))
                return opened[-1]

            def serve(engine: CachedEngine, items: list[tuple[int, int]]) -> None:
                for _, c in items:
                    prompt = convs[c].next_prompt()
                    g = engine.generate(prompt, workload.new_tokens)
                    if g is None:
                        raise HiCacheError("the demo's device pool is too small for its requests")
                    totals.add(g)
                    convs[c].answer(prompt, g.output_ids)
                    # The user's next turn comes seconds later; by then a real engine's
                    # scheduler loop has long reported the write-through backup.
                    engine.wait_backups()

            phase1 = [(t, c) for t, c in schedule if t < turns - 1]
            phase2 = [(t, c) for t, c in schedule if t == turns - 1]
            if phase1:
                t0 = time.perf_counter()
                pair = [new_engine(), new_engine()]
                for t, c in phase1:  # each turn on the other engine than the last one
                    serve(pair[(t + c) % 2], [(t, c)])
                for e in pair:
                    e.wait_backups()
                daemon_runs.append(_daemon_stats(daemon))
                close_engines()
                print(f"phase 1   turns 1-{turns - 1} on 2 engines, each turn on the other one: "
                      f"{len(phase1)} requests in {time.perf_counter() - t0:.1f}s")
            if phase2:
                t0 = time.perf_counter()
                if phase1 and disk_on:
                    rc = daemon.stop()
                    if rc != 0:
                        raise HiCacheError(f"the daemon exited with {rc} on SIGTERM:\n{daemon.read_log()[-4000:]}")
                    daemon.start()
                    what = "daemon restarted (host tier empty, disk tier kept); "
                else:
                    what = ""
                late = new_engine()
                serve(late, phase2)
                late.wait_backups()
                if not what and daemon_runs:
                    daemon_runs.pop()  # the same daemon run: its counters include phase 1
                daemon_runs.append(_daemon_stats(daemon))
                close_engines()
                print(f"phase 2   {what}turn {turns} on a new engine: {len(phase2)} requests in "
                      f"{time.perf_counter() - t0:.1f}s")
        finally:
            try:
                close_engines()
            finally:
                rc = daemon.stop()
    _print_summary(daemon_runs, totals, disk_on)
    print(f"daemon stopped {'cleanly (SIGTERM, exit 0)' if rc == 0 else f'with exit status {rc}'}; "
          f"demo took {time.perf_counter() - t_start:.1f}s")
    return 0 if rc == 0 else 1


def _daemon_stats(daemon: LocalDaemon) -> dict:
    from hicache.client.connection import RpcConnection

    conn = RpcConnection.connect(daemon.socket, timeout_s=10.0)
    try:
        conn.hello()
        return conn.call("stats", {})
    finally:
        conn.close()


def _print_summary(runs: list[dict], totals: EngineStats, disk_on: bool) -> None:
    requested = sum(r["requests"]["requested_pages"] for r in runs)
    print("tier hit rates (daemon: pages matched / pages looked up)")
    for tier in ("device", "host", "disk"):
        if tier == "disk" and not disk_on:
            print("  disk     -      (no disk tier)")
            continue
        # each run reports matched / max(1, requested)
        matched = sum(r["tiers"][tier]["hit_rate"] * max(1, r["requests"]["requested_pages"]) for r in runs)
        print(f"  {tier:<8} {matched / max(1, requested):6.1%}")
    t = totals
    print(f"prefill   {t.computed_tokens:,} of {t.prompt_tokens:,} prompt tokens computed, "
          f"{t.saved_tokens / max(1, t.prompt_tokens):.1%} saved "
          f"(reused from device {t.device_tokens:,}, host {t.host_tokens:,}, disk {t.disk_tokens:,})")
    ttft = np.asarray(t.ttft_s) * 1e3
    if len(ttft):
        print(f"time to first token  mean {ttft.mean():.1f} ms, p50 {np.median(ttft):.1f} ms")
