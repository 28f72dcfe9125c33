"""The hicache daemon: one sub-package per concern, imports flowing downwards.

  serve/   lifecycle (startup, serve, shutdown, the launcher, the GC steward) and the
           RPC handlers: what a connection sees. Imports everything below.
  hybrid/  hybrid models' state checkpoints beside the KV, and their disk movement.
  movers/  the tier movers: disk (write-through, demotion, prefetch, rebuild) and remote.
  ingest/  how pages come in: one reserve -> copy -> commit protocol (protocol.py) that
           the engine cycle's backups, vLLM's host puts, SGLang's keyed stores and the
           remote tier's fetches all end in.
  core/    the engine cycle (CacheService), the records every part shares, the host
           tier's slabs and their reclaim.

One exception to "downwards", by design: core/service.py plans the engine cycle's backups
through ingest/backups.py and ingest/protocol.py, which import only core/records.py
and core/host_tier.py (no module imports one that imports it back).
"""
