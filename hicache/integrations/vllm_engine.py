"""How the vLLM drivers build an engine from a spec and read its counters: shared by the
one-`generate`-per-turn driver (vllm_driver.py), the concurrent one (vllm_async_driver.py) and
the step-by-step one (vllm_step_driver.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments for `spec` (LLM and AsyncEngineArgs take the same)."""
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    elif spec.get("socket"):
        extra = {"socket": spec["socket"]}
        extra.update(spec.get("extra_config", {}))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    if spec.get("in_process"):
        kwargs["distributed_executor_backend"] = "uni"
    for key in ("max_num_batched_tokens", "max_num_seqs"):  # the scheduler's step budget
        if spec.get(key):
            kwargs[key] = int(spec[key])
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events_endpoint"])
    return dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
                block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 2048),
                enforce_eager=True, kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
                disable_log_stats=False, seed=0, tensor_parallel_size=spec.get("tp", 1), **kwargs)


def counters() -> dict[str, float]:
    """vLLM's prefix-cache, prompt-token and connector counters in this process, as floats (vLLM's
    own snapshot, `get_metrics`, truncates counters to int: the connector's seconds would be lost)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.type != "counter" or not metric.name.startswith("vllm:"):
            continue
        if any(w in metric.name for w in ("prefix_cache", "prompt_tokens", "hicache")):
            out[metric.name] = sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return out


def reset_prefix_cache(engine: Any, timeout_s: float, step: Callable[[], Any] | None = None) -> None:
    """Clear vLLM's own prefix cache (an LLM or an LLMEngine). vLLM refuses while any block is
    held, and requests whose saves still run keep theirs after they finish (the connector
    delays their free): try until it takes, stepping the engine in between when the caller
    drives the steps (`step`; otherwise the engine core steps by itself), and fail loudly
    past `timeout_s` (blocks held that long are a connector that never reports its saves)."""
    deadline = time.monotonic() + timeout_s
    while not engine.reset_prefix_cache(reset_connector=False):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be reset in {timeout_s:g} s: blocks still held")
        if step is not None:
            step()
        time.sleep(0.001 if step is not None else 0.01)
