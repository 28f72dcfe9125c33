"""Adapters that let real inference engines use hicache as the tier below their own
device prefix cache: `hicache.integrations.vllm` (a vLLM v1 KV connector) and
`hicache.integrations.sglang` (an SGLang HiCache storage backend).

Modules:
  block_copy.py         Copies between an engine's own per-layer KV block tensors and host arena pages.
  block_streams.py      Copies of an engine's own KV blocks on CUDA (the vLLM worker's).
  request_keys.py       Page keys of an engine request whose KV depends on more than its token ids.
  sglang.py             hicache as SGLang's HiCache L3.
  sglang_cpu.py         SGLang's real host KV pools on a CPU-only machine, for hicache's tests and benchmarks.
  vllm/                 hicache as vLLM's host and disk KV tier: `HiCacheConnector` (see connector.py).
  vllm_async_driver.py  Concurrent conversations through vLLM's AsyncLLM, in this process.
  vllm_call_clock.py    Times every call vLLM makes into a KV connector, by method.
  vllm_driver.py        Run one vLLM engine in this process over token-id prompts and print what it did as JSON.
  vllm_engine.py        How the vLLM drivers build an engine from a spec and read its counters.
  vllm_step_driver.py   One vLLM engine in this process, kept for a whole bench run and driven step by step.
"""
