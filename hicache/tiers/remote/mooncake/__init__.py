"""The remote tier on Mooncake Store: the store, the helper process that owns the Mooncake client, and the
memory they share.

Modules:
  helper.py   The Mooncake client's own process: `python -m hicache.tiers.remote.mooncake.helper`.
  staging.py  Staging: the extents of the memfd area a daemon shares with its Mooncake helper.
  store.py    MooncakeStore: the remote tier on Mooncake Store (`mooncake://MASTER_HOST:PORT`).
"""
