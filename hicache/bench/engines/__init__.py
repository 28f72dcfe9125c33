"""Real inference engines serving through hicache: vLLM, SGLang, the reference engine (and `hicache demo`), and
the tiny model they load.

Modules:
  demo.py                `hicache demo`: a daemon with embedded defaults and a short multi-turn workload...
  multiturn_bench.py     `hicache bench multiturn`: the reference engine serving multi-turn conversations.
  sglang_bench.py        SGLang's L3 calls through hicache.
  sglang_serve_bench.py  `hicache bench sglang-serve`: a real SGLang server on a multi-turn workload, four ways.
  tiny_llama.py          A tiny Llama with seeded random weights, saved as safetensors from a local config.
  tiny_tokenizer.py      A word-level tokenizer for the tiny Llama, built locally (no hub).
  vllm_bench.py          `hicache bench vllm`: a real vLLM engine serving multi-turn conversations through...
  vllm_peers.py          The KV-cache configurations `hicache bench vllm --compare` runs vLLM with.
  vllm_placement.py      Where and at which priority `hicache bench vllm --concurrency` runs a hicache daemon.
  vllm_steps.py          `hicache bench vllm --concurrency N`: N requests at once into vLLM, step by step.
  vllm_steps_report.py   The numbers of `hicache bench vllm --concurrency N`.
  vllm_workload.py       The workloads of `hicache bench vllm`: token-id prompts, and when each is sent.
"""
