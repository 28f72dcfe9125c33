"""One vLLM engine in this process, kept for a whole bench run and driven step by step:
`hicache bench vllm --concurrency N` (hicache/bench/engines/vllm_steps.py) starts one per configuration.

    python -m hicache.integrations.vllm_step_driver SPEC.json RESULT_FD

SPEC: the engine keys of vllm_engine.engine_kwargs ("model", "connector", "block_size",
"kv_cache_bytes", "max_num_batched_tokens", ...) and "socket" (a hicache daemon's: after each
phase the driver waits until it has no put in flight). The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor), so the scheduler, the worker and
both of a connector's roles are here, where `CallClock` times every connector call; the
process is bound to the CPUs vLLM would give its engine process (`bind_like_a_worker`).

Commands arrive one JSON object a line on stdin; each gets one JSON line on RESULT_FD
(the first, before any command: {"ready": true, "init_s": ..., "timed": {role: [methods]}}):

    {"op": "phase", "tag": "r0-reuse", "prompts": [[ids], ...], "max_tokens": 32,
     "reset_prefix_cache": true}
    {"op": "quit"}

A phase adds every prompt with `LLMEngine.add_request` at once, then calls `step()` until
all are done, timing each step and the connector calls inside it; `reset_prefix_cache`
first empties vLLM's own prefix cache (not the connector's), so hits come from the connector.
After the last output the engine is stepped until it holds no request (connectors that save
asynchronously keep finished requests' blocks until the save is done), untimed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from hicache.integrations.vllm_call_clock import CallClock
from hicache.integrations.vllm_engine import engine_kwargs, reset_prefix_cache

DRAIN_TIMEOUT_S = 60.0


def _tolerate_foreign_dicts() -> None:
    """vLLM 0.32's CPU platform, as the worker starts, scans every value of every loaded module
    for a `kernel` in its `vars()` (vllm/triton_utils/dispatcher.py). llvmlite's FFI library
    object, which LMCache's imports load into this process (with a separate engine process they
    stay in the front end), answers every attribute, `__dict__` too, with a function wrapper,
    and the scan fails on it. Values whose `vars()` is no dict hold no kernel: the scan skips them."""
    from vllm.triton_utils import dispatcher

    def dict_vars(value: Any) -> dict:
        d = vars(value)
        return d if isinstance(d, dict) else {}

    dispatcher.vars = dict_vars  # type: ignore[attr-defined]  # the module's own name wins over the builtin


class StepDriver:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        _tolerate_foreign_dicts()
        self.spec = spec
        t0 = time.perf_counter()
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs({**spec, "in_process": True})))
        self.init_s = time.perf_counter() - t0
        self.core = self.engine.engine_core.engine_core  # InprocClient's EngineCore
        self.clock = CallClock()
        self.timed: dict[str, list[str]] = {}
        connectors = {"scheduler": getattr(self.core.scheduler, "connector", None),
                      "worker": get_kv_transfer_group() if has_kv_transfer_group() else None}
        for role, conn in connectors.items():
            if conn is not None:
                self.timed[role] = self.clock.install(conn, role)
        if spec.get("connector") and len(self.timed) != 2:
            raise RuntimeError(f"expected a scheduler and a worker connector in this process, found {list(self.timed)}")
        self._scheduled: tuple[int, int] = (0, 0)  # the last step's (tokens, requests)
        schedule = self.core.scheduler.schedule

        def schedule_and_note(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self._scheduled = (int(out.total_num_scheduled_tokens), len(out.num_scheduled_tokens))
            return out

        self.core.scheduler.schedule = schedule_and_note

    def phase(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        if cmd.get("reset_prefix_cache"):
            reset_prefix_cache(self.engine, DRAIN_TIMEOUT_S, self.engine.step)
        params = SamplingParams(max_tokens=int(cmd["max_tokens"]), temperature=0.0, detokenize=False,
                                ignore_eos=True)
        tag = cmd["tag"]
        prompts = cmd["prompts"]
        self.clock.take_calls()  # calls outside the phase's steps (the reset) are not the steps'
        self.clock.take_step()
        sent: dict[str, float] = {}
        done: dict[str, dict[str, Any]] = {}
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            rid = f"{tag}-{i}"
            sent[rid] = time.perf_counter()
            self.engine.add_request(rid, {"prompt_token_ids": p}, params)
        add_s = time.perf_counter() - t0
        self.clock.take_step()  # add_request makes no connector call today; if it did, not a step's
        first: dict[str, float] = {}
        # [seconds, connector seconds, tokens scheduled, requests scheduled, this thread's CPU seconds]
        steps: list[list[float]] = []
        last = t0
        while self.engine.has_unfinished_requests():
            self._scheduled = (0, 0)
            cpu = time.thread_time()
            ts = time.perf_counter()
            outs = self.engine.step()
            now = time.perf_counter()
            steps.append([now - ts, self.clock.take_step(), *self._scheduled, time.thread_time() - cpu])
            for o in outs:
                rid = o.request_id
                if rid not in first and o.outputs and o.outputs[0].token_ids:
                    first[rid] = now
                if o.finished:
                    done[rid] = {"outputs": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0)}
                    last = now
        calls = self.clock.take_calls()
        drained = self._drain()
        requests = [{"id": i, "outputs": done[rid]["outputs"], "cached": done[rid]["cached"],
                     "prompt_tokens": len(p), "ttft": first[rid] - sent[rid] if rid in first else None}
                    for i, (rid, p) in enumerate((f"{tag}-{i}", p) for i, p in enumerate(prompts))]
        return {"tag": tag, "requests": requests, "wall_s": last - t0, "add_s": add_s, "steps": steps,
                "calls": calls, "drain": drained}

    def _drain(self) -> dict[str, float]:
        """Step until the scheduler holds nothing (asynchronous saves finished), then until the
        daemon has no put in flight; what that took, which no phase's numbers include."""
        t0 = time.perf_counter()
        steps = 0
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.core.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests still held by the scheduler after {DRAIN_TIMEOUT_S:g} s")
            self.engine.step()
            steps += 1
            time.sleep(0.001)
        connector_s = sum(sum(v) for v in self.clock.take_calls().values())
        self.clock.take_step()
        if self.spec.get("socket"):
            from hicache.integrations.vllm_driver import settle_puts

            settle_puts(self.spec["socket"])
        return {"seconds": time.perf_counter() - t0, "steps": steps, "connector_s": connector_s}


def bind_like_a_worker() -> list[int] | None:
    """Put this process where vLLM's CPU executor puts its engine process: OpenMP bound to the
    CPUs left after the last `VLLM_CPU_NUM_OF_RESERVED_CPU` (vLLM writes these variables when it
    spawns the engine; in one process nobody would, and the forward pass would float over every
    core). libgomp binds the main thread as torch loads, so this runs before any import of it;
    the connector's threads find the binding in the same variables (hicache moves its copy thread
    to the reserved CPUs). One NUMA node assumed, as on the machines this bench runs on. The
    worker's CPUs, or None where the environment already chose (OMP_PLACES, an explicit
    VLLM_CPU_OMP_THREADS_BIND) or nothing is left to reserve."""
    if "OMP_PLACES" in os.environ or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 0)
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < reserved < len(cpus):
        return None
    worker = cpus[:len(cpus) - reserved]
    os.environ.update(OMP_PLACES="{" + ",".join(map(str, worker)) + "}", OMP_PROC_BIND="true",
                      OMP_NUM_THREADS=str(len(worker)))
    return worker


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    worker_cpus = bind_like_a_worker()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    driver = StepDriver(spec)
    results.write(json.dumps({"ready": True, "init_s": driver.init_s, "timed": driver.timed,
                              "worker_cpus": worker_cpus}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] != "phase":
            raise ValueError(f"unknown command {cmd['op']!r}")
        results.write(json.dumps(driver.phase(cmd)) + "\n")
    results.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a connector's threads must not keep the process alive; the engine holds nothing to flush


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
