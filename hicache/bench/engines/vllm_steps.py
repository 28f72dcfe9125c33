"""`hicache bench vllm --concurrency N`: N requests at once into vLLM, step by step, through each
configuration of `--compare` (vLLM alone, hicache, LMCache, a hicache daemon placed elsewhere).

Every configuration gets one long-lived engine process (hicache/integrations/vllm_step_driver.py),
started before any measurement and kept to the end, with its server (a hicache daemon, an
LMCache server) beside it; all run under `VLLM_CPU_NUM_OF_RESERVED_CPU=1` (equal CPU, see
vllm_bench.py). Each repeat draws N new prompts (one of a few shared prefixes + a suffix of
its own, hicache/bench/engines/vllm_workload.py) and runs, configuration by configuration, two phases:

1. no reuse: the N prompts, never seen by any cache, all added at once, then `step()` until done;
2. reuse: the same N prompts again after vLLM's own prefix cache is reset, so what is not
   recomputed came from the connector.

The configurations' order rotates from repeat to repeat, so none always runs first or
after the same neighbour. Each engine first runs one unmeasured phase of its own prompts
(kernels warmed, the connector connected). Outputs must be equal to vLLM alone's, request by
request, in every repeat and phase, or the bench refuses to compare. `--hogs N` runs N
CPU-bound processes for the whole run. Before the engines stop, the bench reads what a
starved daemon would show: engines the daemon saw disconnect ("engine N gone" in its log),
the connector's outages ("daemon unavailable" in the engine's log) and puts that expired
unfinished (`hicache stats`, and the daemon's "expired unfinished" log lines).
The numbers: hicache/bench/engines/vllm_steps_report.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hicache.bench.engines.vllm_peers import BASE, EQUAL_CPUS, OutputsDiffer, PeerRun, bench_setup, start_peer
from hicache.bench.engines.vllm_placement import CpuHogs
from hicache.bench.engines.vllm_steps_report import PhaseRun, rows, summary_table
from hicache.bench.engines.vllm_workload import shared_prefix_prompts
from hicache.progress import Progress

log = logging.getLogger(__name__)

PHASES = ("no reuse", "reuse")
WARMUP_SEED = 1 << 20  # the warm-up's prompts: a seed no repeat uses


class EngineProcess:
    """One step driver: JSON commands on its stdin, one JSON result a line on a pipe of its own
    (its stdout and stderr go to `log_path`: vLLM logs to both)."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: Path, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        spec_path = workdir / f"{safe}.engine.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = workdir / f"{safe}.engine.log"
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hicache.integrations.vllm_step_driver", str(spec_path), str(write_fd)],
                stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                env={**os.environ, **EQUAL_CPUS}, start_new_session=True)
        os.close(write_fd)
        self._results = os.fdopen(read_fd, "rb")
        self._buffer = b""
        self.ready = self._read(timeout_s)

    def phase(self, tag: str, prompts: list[list[int]], max_tokens: int, reset_prefix_cache: bool) -> dict[str, Any]:
        cmd = {"op": "phase", "tag": tag, "prompts": prompts, "max_tokens": max_tokens,
               "reset_prefix_cache": reset_prefix_cache}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(self._failed("exited")) from None
        return self._read(self.timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        fd = self._results.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(self._failed(f"gave no answer in {timeout_s:g} s"))
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(self._failed("exited"))
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _failed(self, what: str) -> str:
        tail = self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""
        return f"vLLM engine {self.name} {what} (its log: {self.log_path}):\n{tail}"

    def log_count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log_path.read_text(errors="replace")))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._results.close()


@dataclass
class Setup:
    """What every configuration runs: the model, the engine's limits, the workload."""

    model: str
    block_size: int
    kv_cache_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    concurrency: int
    prefixes: int
    prefix_tokens: int
    prompt_tokens: tuple[int, int]
    max_tokens: int
    seed: int

    def engine_spec(self, peer: PeerRun) -> dict[str, Any]:
        return {"model": self.model, "connector": peer.connector, "socket": peer.socket,
                "block_size": self.block_size, "kv_cache_bytes": self.kv_cache_bytes,
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs": max(self.concurrency, 1)}

    def prompts(self, seed: int) -> list[list[int]]:
        return shared_prefix_prompts(self.concurrency, self.prefixes, self.prefix_tokens, *self.prompt_tokens,
                                     seed=seed)


def daemon_counters(peer: PeerRun, engine: EngineProcess) -> dict[str, float]:
    """What a starved daemon shows, read while the engine still runs (its exit is a disconnect too)."""
    if peer.socket is None:
        return {}
    from hicache.client.connection import RpcConnection

    text = peer.daemon_log.read_text(errors="replace") if peer.daemon_log else ""
    puts = RpcConnection.one_call(peer.socket, "stats", timeout_s=10.0).get("puts") or {}
    return {"engines gone (daemon log)": float(len(re.findall(r"engine \d+ gone", text))),
            "puts expired unfinished (daemon log)": float(text.count("expired unfinished")),
            "puts expired (stats)": float(puts.get("expired", 0)),
            "puts failed (stats)": float(puts.get("failed", 0)),
            "connector outages (engine log)": float(engine.log_count(r"daemon unavailable"))}


def check_outputs(runs: list[PhaseRun]) -> None:
    """OutputsDiffer unless every configuration generated vLLM alone's tokens, request by request."""
    base = {(r.repeat, r.phase): r for r in runs if r.config == BASE}
    for r in runs:
        want = base[(r.repeat, r.phase)].requests
        bad = [i for i, (a, b) in enumerate(zip(want, r.requests, strict=True)) if a["outputs"] != b["outputs"]]
        if bad:
            raise OutputsDiffer(f"outputs of {r.config} differ from {BASE}'s in {len(bad)} of {len(want)} requests "
                                f"(repeat {r.repeat + 1}, {r.phase}, first: request {bad[0]}): not a valid comparison")


def measure(args: argparse.Namespace) -> tuple[list[PhaseRun], dict[str, dict[str, float]], dict[str, float]]:
    """Every configuration's phases in every repeat, the daemons' counters, and the run's facts
    (load averages, hogs)."""
    names, workdir, model = bench_setup(args, "hicache-bench-vllm-steps-")
    setup = Setup(str(model), args.block_size, args.kv_cache_mib << 20, args.max_model_len,
                  args.max_num_batched_tokens, args.concurrency, args.prefixes, args.prefix_tokens,
                  args.prompt_tokens, args.max_tokens, args.seed)
    facts = {"load average at start (1 min)": os.getloadavg()[0], "cpu hogs": float(args.hogs)}
    shown = Progress("bench vllm --concurrency", total=len(names) * (1 + 2 * args.repeats), unit="phases")
    done = 0
    runs: list[PhaseRun] = []
    with ExitStack() as stack:
        stack.enter_context(CpuHogs(args.hogs))
        peers: dict[str, PeerRun] = {}
        engines: dict[str, EngineProcess] = {}
        for name in names:
            shown.update(done, note=f"starting {name}")
            peers[name] = stack.enter_context(start_peer(name, workdir, args.block_size))
            engines[name] = EngineProcess(name, setup.engine_spec(peers[name]), workdir, args.timeout_s)
            stack.callback(engines[name].stop)
            engines[name].phase("warmup", setup.prompts(WARMUP_SEED), setup.max_tokens, False)
            done += 1
        for repeat in range(args.repeats):
            prompts = setup.prompts(setup.seed + repeat)
            k = repeat % len(names)
            for name in names[k:] + names[:k]:
                for phase in PHASES:
                    shown.update(done, note=f"repeat {repeat + 1}: {name}, {phase}")
                    out = engines[name].phase(f"r{repeat}-{phase.replace(' ', '-')}", prompts, setup.max_tokens,
                                              reset_prefix_cache=phase == "reuse")
                    runs.append(PhaseRun.from_result(name, repeat, phase, out))
                    done += 1
        counters = {name: daemon_counters(peers[name], engines[name]) for name in names}
        facts["load average at end (1 min)"] = os.getloadavg()[0]
    shown.update(done)
    shown.close()
    raw = {"runs": [asdict(r) for r in runs], "counters": counters, "facts": facts}
    (workdir / "runs.json").write_text(json.dumps(raw))  # every step and call, to look at again
    check_outputs(runs)
    return runs, counters, facts


def check_args(args: argparse.Namespace) -> None:
    """SystemExit naming the first option out of range, before anything starts."""
    for name, low in (("concurrency", 1), ("repeats", 1), ("prefixes", 1), ("prefix_tokens", 1), ("hogs", 0),
                      ("max_tokens", 1), ("max_num_batched_tokens", 1)):
        if getattr(args, name) < low:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    lo, hi = args.prompt_tokens
    if not args.prefix_tokens < lo:
        raise SystemExit(f"--prompt-tokens {lo}-{hi}: the shortest prompt must be longer than --prefix-tokens "
                         f"({args.prefix_tokens}), each has a suffix of its own")
    if hi + args.max_tokens > args.max_model_len:
        raise SystemExit(f"--prompt-tokens up to {hi} + --max-tokens {args.max_tokens} exceed --max-model-len "
                         f"{args.max_model_len}")


def run(args: argparse.Namespace) -> list[dict]:
    check_args(args)
    try:
        runs, counters, facts = measure(args)
    except OutputsDiffer as e:
        raise SystemExit(str(e)) from None
    except RuntimeError as e:  # an engine failed: its log's tail says why
        raise SystemExit(str(e)) from None
    print(summary_table(runs, counters), file=sys.stderr)
    return rows(runs, counters, facts)
