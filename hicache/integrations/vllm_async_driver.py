"""Concurrent conversations through vLLM's AsyncLLM, in this process: the `arrivals` mode of
hicache/integrations/vllm_driver.py (`hicache bench vllm --arrivals poisson`).

SPEC, beyond the driver's engine keys: "conversations": [[prompt of turn 0, turn 1, ...], ...],
"gaps": [[seconds before turn 0 (from the start), before turn 1 (after answer 0), ...], ...].

Each conversation is one task: it sleeps its gap, sends its turn, reads the answer as vLLM
streams it, and only then waits for its next turn, so requests of different conversations
overlap in vLLM's batches as a server's would. vLLM's prefix cache is not reset (requests are
always running); a small KV cache (`kv_cache_bytes`) evicts conversations between their turns,
as device memory pressure does. Time to first token is measured here, from sending the request
to its first streamed token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hicache.integrations.vllm_engine import counters, engine_kwargs


async def _conversation(engine: Any, c: int, prompts: list[list[int]], gaps: list[float], params: Any,
                        t0: float, done: list[dict[str, Any]]) -> None:
    for t, (prompt, gap) in enumerate(zip(prompts, gaps, strict=True)):
        await asyncio.sleep(gap)
        sent = time.perf_counter()
        first: float | None = None
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=f"conv{c}-turn{t}"):
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
            final = out
        end = time.perf_counter()
        assert final is not None
        done.append({"conversation": c, "turn": t, "outputs": list(final.outputs[0].token_ids),
                     "cached": final.num_cached_tokens, "ttft": None if first is None else first - sent,
                     "latency": end - sent, "sent_s": sent - t0})


async def _serve(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(spec)))
    init_s = time.perf_counter() - t0
    try:
        params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
        done: list[dict[str, Any]] = []
        start = time.perf_counter()
        await asyncio.gather(*(_conversation(engine, c, prompts, gaps, params, start, done)
                               for c, (prompts, gaps) in enumerate(zip(spec["conversations"], spec["gaps"],
                                                                       strict=True))))
        wall = time.perf_counter() - start
        snapshot = counters()
    finally:
        engine.shutdown()
    done.sort(key=lambda r: (r["conversation"], r["turn"]))
    return {"init_s": init_s, "wall_s": wall, "requests": done, "counters": snapshot}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_serve(spec))
