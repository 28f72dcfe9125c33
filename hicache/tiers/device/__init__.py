"""The device tier: the engine's KV pool, its token-slot allocators and hybrid models' state slots.

Modules:
  allocator.py   Token-slot allocators for the device KV pool.
  pool.py        The device tier: the engine's KV pool (SGLang's MHATokenToKVPool / MLATokenToKVPool).
  state_pool.py  StatePool: an engine's device slots for hybrid-model recurrent state (SGLang's MambaPool).
"""
