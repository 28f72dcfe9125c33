"""The disk tier (L3): KV pages in one LMDB environment that survives restarts, written by one thread (its put
loop in C: native.c).

Modules:
  batch.py     Batched puts for the disk tier (``DiskTier.put_many_async``).
  budget.py    The disk tier's map budget: how much of LMDB's fixed-size map a write transaction may fill...
  config.py    DiskTierConfig: the disk tier's tuning knobs.
  env.py       The disk tier's environment directory: the open protocol, the clean/unclean marker.
  format.py    On-disk format of the LMDB disk tier (hicache/tiers/disk/tier.py): records and checksums.
  freelist.py  The free pages of the disk tier's LMDB map by contiguous run, for the writer's map budget.
  native.py    The disk writer's put loop in C: one call writes a run of queued puts and batch parts.
  ops.py       The disk writer's queue entries (hicache/tiers/disk/writer.py): puts, deletions.
  queue.py     The disk writer's queue (hicache/tiers/disk/writer.py): any thread appends puts, batches.
  recovery.py  The disk writer after a failed transaction: make room and retry, op by op, write faults.
  scan.py      The disk tier's records read whole at start-up.
  tier.py      The disk tier (L3): KV pages in one LMDB environment that survives restarts.
  txn_ops.py   The disk writer's work inside its write transaction: puts (budgets, evict hook), deletions.
  writer.py    The disk tier's writer: the one thread that runs every LMDB write transaction of...
"""
