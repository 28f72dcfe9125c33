"""The host tier (L2): the shared-memory arena, its page slots, and the KV view engines map.

Modules:
  arena.py     The host arena (its page-slot allocator is in slots.py).
  kv_cache.py  The host tier (L2) as engines see it: `HostKVCache`, the arena viewed as KV pages.
  slots.py     The page-slot allocator of one host slab: which slot ids of the slab are free.
"""
