"""The tier movers: pages between the host tier and the tiers below it.

disk_mover.py (the disk tier's hooks, budget, prefetch, the rebuild at startup),
disk_writes.py (its writes: write-through, the backlog a full queue leaves, demotion),
disk_jobs.py (its writes and prefetches in flight),
disk_namespaces.py (the namespaces file the rebuild reads), disk_startup.py
(opening the LMDB tier, quarantining a damaged one, reading and checking its records),
disk_restore.py (the records put back on the indexes, a big tier's while the daemon
answers), state_dir.py (the daemon's
private state directory), remote_mover.py (the shared remote tier, Redis / Valkey
or Mooncake Store: write-through, flush), remote_lookup.py (its lookups: a probe
started at match and run in the background, the fetch, the fold at load),
remote_publish.py (offers the store the pages held only on disk, each time it
comes up), remote_admission.py (which pages a full store is still sent).
"""
