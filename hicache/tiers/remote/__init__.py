"""The remote tier (L4): a store shared by daemons on many hosts (Redis / Valkey or Mooncake Store), its
records, their authentication, its worker thread.

Modules:
  auth.py         Authenticated remote records: the cluster secret, its key ids, the record MAC.
  breaker.py      The remote tier's circuit breaker rule: when a store is failing, not merely slow.
  mooncake/       The remote tier on Mooncake Store: the store.
  record.py       Records of the remote tier (L4): one self-describing value per page.
  redis_store.py  RedisStore: the remote tier on Redis or Valkey, standalone or Cluster (redis-py asyncio).
  store.py        The remote-store interface: what the remote tier (L4) needs from a shared store.
  worker.py       RemoteWorker: the remote store's own thread and event loop, and its circuit breaker.
"""
