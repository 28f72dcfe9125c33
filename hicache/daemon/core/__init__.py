"""The engine cycle and what every other part of the daemon builds on.

records.py (namespaces, engines, match handles, counters: plain records),
host_tier.py (the host arena's slabs, owned by one namespace at a time),
slab_reclaim.py (emptying a slab so another namespace can grow), service.py
(CacheService: register, match, load, insert, evict, release), eviction.py (its
eviction side: the shared host budget, a namespace's host and disk evictions, admin
flush and evict_tier, freed pages back to their owners),
validation.py (malformed keys and device page ids refused before anything changes),
quotas.py (tenant quotas: minimum and maximum shares of host and disk, the victim
tenant under them), fetch_or_recompute.py (whether a disk or remote part of a match is
worth loading), retention.py (pinned prefixes: bounds, expiry, quotas, restore) and
pin_file.py (the pins file kept next to the disk tier).
"""
