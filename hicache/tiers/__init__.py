"""The storage tiers, one sub-package each: device, host (L2), disk (L3), remote (L4).

Modules:
  device/  The device tier: the engine's KV pool, its token-slot allocators and hybrid models' state slots.
  disk/    The disk tier (L3): KV pages in one LMDB environment that survives restarts, written by one thread.
  host/    The host tier (L2): the shared-memory arena, its page slots, and the KV view engines map.
  remote/  The remote tier (L4): a store shared by daemons on many hosts (Redis / Valkey or Mooncake Store).
"""
