"""The reference engine: a tiny transformer with paged attention, and its runner.

Modules:
  attention.py     Paged attention over the DevicePool, and the batch-invariant contraction it is built on.
  cached.py        CachedEngine: the reference engine serving requests through hicache, as vLLM or SGLang would.
  hybrid_model.py  A hybrid reference model: recurrent (linear-attention) layers beside attention layers.
  model.py         The reference engine's model: a tiny decoder-only transformer with paged KV.
  runner.py        A small engine around TinyTransformer: request state, slot tables, prefill, decode.
"""
