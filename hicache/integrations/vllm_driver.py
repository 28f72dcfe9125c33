"""Run one vLLM engine in this process over token-id prompts and print what it did as JSON:
the proof tests, `hicache bench vllm` and anyone checking an install use it.

    python -m hicache.integrations.vllm_driver SPEC.json

SPEC: {"model": dir, "socket": path or null (no connector), "block_size": 32,
       "rounds": [[prompt token lists], ...], "max_tokens": 8,
       "reset_between_rounds": true, "corrupt_load": false, "fail_load": false, "kv_cache_bytes": 67108864,
       "kill_in_round" | "stop_in_round": k, "cont_before_round": k2, "fault_delay_s": 0.02,
       "daemon_pid": pid}

Each round is one `generate` call; between rounds the driver waits for the daemon to
have no store in flight (`settle`, default on), and vLLM's own prefix cache is cleared
(`reset_prefix_cache(reset_connector=False)`) so hits must come from hicache.
`corrupt_load` garbles every block hicache loads (a test that must see outputs change,
proving the KV is really used); `fail_load` makes every hicache load fail (vLLM must
recompute); both run vLLM's engine and worker in this process. The output JSON has per round the
output token ids, `num_cached_tokens` per request and the time to first token, plus
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
from pathlib import Path
from typing import Any

RESULT = "HICACHE_RESULT "  # the line of stdout that carries the result


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if type(m).__name__ == "Counter" and any(w in m.name for w in ("prefix_cache", "prompt_tokens", "hicache")):
            out[m.name] = out.get(m.name, 0) + float(m.value)
    return out


def run_in_process(spec: dict[str, Any], workdir: Path, name: str, env: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Run one vLLM as its own process on `spec` (kept with its log as workdir/NAME.json, .log);
    its result, or RuntimeError with the tail of its output."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "hicache.integrations.vllm_driver", str(path)],
                          capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM run {name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def _corrupt_loads() -> None:
    """Make every hicache load write wrong bytes (flip the low bit of each element)."""
    import torch

    from hicache.integrations.block_copy import BlockCopier

    real = BlockCopier.load_layer

    def load_layer(self: BlockCopier, layer: int, block_ids: Any, host_pages: Any) -> None:
        real(self, layer, block_ids, host_pages)
        b = torch.as_tensor(list(block_ids), dtype=torch.long)
        v = self.blocks[layer]
        v[b] = -v[b] + 1.0

    BlockCopier.load_layer = load_layer  # type: ignore[method-assign]


def _fail_loads() -> None:
    """Make every hicache load fail after copying half of the layers (the connector must
    report it and vLLM recompute, whatever the blocks hold)."""
    from hicache.integrations.block_copy import BlockCopier

    real = BlockCopier.load_layer

    def load_layer(self: BlockCopier, layer: int, block_ids: Any, host_pages: Any) -> None:
        if layer >= self.layout.num_layers // 2:
            raise OSError("injected load failure")
        real(self, layer, block_ids, host_pages)

    BlockCopier.load_layer = load_layer  # type: ignore[method-assign]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("socket"):
        extra = {"socket": spec["socket"]}
        extra.update(spec.get("extra_config", {}))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    if spec.get("in_process"):
        kwargs["distributed_executor_backend"] = "uni"
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
              block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 2048),
              enforce_eager=True, kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
              disable_log_stats=False, seed=0, tensor_parallel_size=spec.get("tp", 1), **kwargs)
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    rounds = []
    for i, prompts in enumerate(spec["rounds"]):
        if i and spec.get("socket") and spec.get("settle", True):
            _settle(spec["socket"])
        if i and spec.get("reset_between_rounds", True):
            llm.reset_prefix_cache(reset_connector=False)
        # fault injection: the daemon dies (SIGKILL) or hangs (SIGSTOP) during a round, or wakes up
        for key, sig in (("kill_in_round", signal.SIGKILL), ("stop_in_round", signal.SIGSTOP)):
            if spec.get(key) == i:
                threading.Timer(spec.get("fault_delay_s", 0.02), os.kill, (int(spec["daemon_pid"]), sig)).start()
        if spec.get("cont_before_round") == i:
            os.kill(int(spec["daemon_pid"]), signal.SIGCONT)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        rounds.append({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "cached": [o.num_cached_tokens for o in outs],
                       "ttft": [_ttft(o) for o in outs], "wall_s": wall})
    hma = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    return {"init_s": init_s, "rounds": rounds, "counters": _counters(llm), "hybrid_kv_cache_manager": hma}


def _settle(socket: str, timeout_s: float = 30.0) -> None:
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


def _ttft(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    ttft = getattr(m, "first_token_latency", None)
    return None if ttft is None else float(ttft)


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
    result = run(spec)
    out = spec.get("out")
    text = json.dumps(result)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(RESULT + text, flush=True)


if __name__ == "__main__":
    main()
