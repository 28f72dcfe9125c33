"""Adapters that let real inference engines use hicache as the tier below their own
device prefix cache: `hicache.integrations.vllm` (a vLLM v1 KV connector) and
`hicache.integrations.sglang` (an SGLang HiCache storage backend)."""
