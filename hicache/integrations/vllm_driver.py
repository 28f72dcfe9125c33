"""Run one vLLM engine in this process over token-id prompts and print what it did as JSON:
the proof tests, `hicache bench vllm` and anyone checking an install use it.

    python -m hicache.integrations.vllm_driver SPEC.json

SPEC: {"model": dir, "socket": path or null (no connector), "block_size": 32,
       "connector": {KVTransferConfig fields} (another connector instead of hicache's),
       "rounds": [[prompt token lists], ...], "max_tokens": 8,
       "reset_between_rounds": true, "corrupt_load": false, "fail_load": false, "kv_cache_bytes": 67108864,
       "kill_in_round" | "stop_in_round": k, "cont_before_round": k2, "fault_delay_s": 0.02,
       "daemon_pid": pid, "kv_events_endpoint": "tcp://127.0.0.1:PORT", "extra_config": {...},
       "pause_dir": dir, "pause_before_rounds": [k, ...],
       "kv_transfer_params": [[params or null per prompt] or null, per round] (e.g. hicache's retention hint)}
or, for concurrent conversations through AsyncLLM (hicache/integrations/vllm_async_driver.py),
      {"arrivals": "poisson", "conversations": [[turn prompts], ...], "gaps": [[seconds], ...], ...}

Each round is one `generate` call; between rounds the driver waits for the daemon to
have no store in flight (`settle`, default on), and vLLM's own prefix cache is cleared
(`reset_prefix_cache(reset_connector=False)`) so hits must come from hicache.
`kv_events_endpoint` turns on vLLM's KV event publisher (ZMQ PUB bound there). Before
each round of `pause_before_rounds` the driver creates `pause_dir/paused-K` and waits for
`pause_dir/resume-K` (a test inspects the daemon and the event stream meanwhile), or
exits when `pause_dir/abort` appears.
`corrupt_load` garbles every block hicache loads (a test that must see outputs change,
proving the KV is really used); `fail_load` makes every hicache load fail (vLLM must
recompute); both run vLLM's engine and worker in this process. The output JSON has per round the
output token ids, `num_cached_tokens` per request, the time to first token and two parts of it
(`queued`, `prefill`: see `_engine_parts`), plus
vLLM's counters (`vllm:external_prefix_cache_hits` and friends) at the end, and whether
vLLM kept its hybrid KV cache manager on (`hybrid_kv_cache_manager`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from hicache.integrations.vllm_engine import counters, engine_kwargs, reset_prefix_cache

RESULT = "HICACHE_RESULT "  # the line of stdout that carries the result
RESET_TIMEOUT_S = 60.0  # between rounds: the last saves of a round finish well within it


def run_in_process(spec: dict[str, Any], workdir: Path, name: str, env: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Run one vLLM as its own process on `spec` (kept with its log as workdir/NAME.json, .log);
    its result, or RuntimeError with the tail of its output."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(spec))
    # its own session: a timeout ends vLLM's engine and worker processes too, not only the driver
    proc = subprocess.Popen([sys.executable, "-m", "hicache.integrations.vllm_driver", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        (workdir / f"{name}.log").write_text(stdout + stderr)
        raise
    (workdir / f"{name}.log").write_text(stdout + stderr)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM run {name} failed:\n{(stdout + stderr)[-6000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def _corrupt_loads() -> None:
    """Make every hicache load write wrong bytes (flip the low bit of each element)."""
    import torch

    from hicache.integrations.block_copy import BlockCopier

    real = BlockCopier.load_layer

    def load_layer(self: BlockCopier, layer: int, block_ids: Any, host_pages: Any, **kw: Any) -> None:
        real(self, layer, block_ids, host_pages, **kw)
        b = torch.as_tensor(list(block_ids), dtype=torch.long)
        v = self.blocks[layer]
        v[b] = -v[b] + 1.0

    BlockCopier.load_layer = load_layer  # type: ignore[method-assign]


def _fail_loads() -> None:
    """Make every hicache load fail after copying half of the layers (the connector must
    report it and vLLM recompute, whatever the blocks hold)."""
    from hicache.integrations.block_copy import BlockCopier

    real = BlockCopier.load_layer

    def load_layer(self: BlockCopier, layer: int, block_ids: Any, host_pages: Any, **kw: Any) -> None:
        if layer >= self.layout.num_layers // 2:
            raise OSError("injected load failure")
        real(self, layer, block_ids, host_pages, **kw)

    BlockCopier.load_layer = load_layer  # type: ignore[method-assign]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    rounds = []
    for i, prompts in enumerate(spec["rounds"]):
        if i and spec.get("socket") and spec.get("settle", True):
            settle_puts(spec["socket"])
        if i and spec.get("reset_between_rounds", True):
            reset_prefix_cache(llm, RESET_TIMEOUT_S)
        if i in spec.get("pause_before_rounds", ()):
            _pause(Path(spec["pause_dir"]), i)
        # fault injection: the daemon dies (SIGKILL) or hangs (SIGSTOP) during a round, or wakes up
        for key, sig in (("kill_in_round", signal.SIGKILL), ("stop_in_round", signal.SIGSTOP)):
            if spec.get(key) == i:
                threading.Timer(spec.get("fault_delay_s", 0.02), os.kill, (int(spec["daemon_pid"]), sig)).start()
        if spec.get("cont_before_round") == i:
            os.kill(int(spec["daemon_pid"]), signal.SIGCONT)
        t = time.perf_counter()
        per_prompt = (spec.get("kv_transfer_params") or {})
        per_prompt = per_prompt[i] if i < len(per_prompt) else None
        if per_prompt:  # each request its own kv_transfer_params, as an API server passes them on
            params_of = [params if kv is None else params.clone() for kv in per_prompt]
            for sp, kv in zip(params_of, per_prompt):
                if kv is not None:
                    sp.extra_args = {"kv_transfer_params": kv}
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_of, use_tqdm=False)
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        rounds.append({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "cached": [o.num_cached_tokens for o in outs],
                       "ttft": [_ttft(o) for o in outs], "queued": [_engine_parts(o)[0] for o in outs],
                       "prefill": [_engine_parts(o)[1] for o in outs], "wall_s": wall, "counters": counters()})
    hma = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    return {"init_s": init_s, "rounds": rounds, "counters": counters(), "hybrid_kv_cache_manager": hma}


def settle_puts(socket: str, timeout_s: float = 30.0) -> None:
    """Wait until the daemon has no put in flight: what the last round computed is stored
    (vLLM's generate returns before its last saves are committed). A daemon that is gone
    or hung has nothing to settle."""
    from hicache.client.connection import RpcConnection
    from hicache.errors import HiCacheError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not RpcConnection.one_call(socket, "stats", timeout_s=2.0)["puts"]["pending"]:
                return
        except (HiCacheError, OSError):
            return
        time.sleep(0.01)


def _pause(pause_dir: Path, i: int, timeout_s: float = 600.0) -> None:
    (pause_dir / f"paused-{i}").touch()
    deadline = time.monotonic() + timeout_s
    while not (pause_dir / f"resume-{i}").exists():
        if (pause_dir / "abort").exists():
            raise RuntimeError(f"aborted before round {i}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nobody resumed round {i} within {timeout_s:g} s")
        time.sleep(0.01)


def _ttft(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    ttft = getattr(m, "first_token_latency", None)
    return None if ttft is None else float(ttft)


def _engine_parts(out: Any) -> tuple[float | None, float | None]:
    """Two parts of a request's TTFT, from vLLM's engine-core timestamps: waiting in the
    scheduler's queue (added to first scheduled: queued behind other requests' steps, or a
    connector that asks to be asked again) and first scheduled to first token (its
    prefill steps, the connector's loads within them). The rest of the TTFT is the way in
    (the engine core reads new requests only between steps) and out."""
    m = getattr(out, "metrics", None)
    queued, scheduled, first = (getattr(m, k, 0.0) for k in ("queued_ts", "scheduled_ts", "first_token_ts"))
    if not (queued and scheduled and first):
        return None, None
    return scheduled - queued, first - scheduled


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("corrupt_load"):  # the worker must run in this process for the patch to reach it
        spec["in_process"] = True
        _corrupt_loads()
    if spec.get("fail_load"):
        spec["in_process"] = True
        _fail_loads()
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("arrivals"):  # concurrent conversations through vLLM's AsyncLLM
        from hicache.integrations.vllm_async_driver import run as run_arrivals
        result = run_arrivals(spec)
    else:
        result = run(spec)
    out = spec.get("out")
    text = json.dumps(result)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(RESULT + text, flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # a connector's threads can keep a failed process alive: exit, with the trace
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
