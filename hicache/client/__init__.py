"""hicache.client: the engine-side library (RPC connection, EngineCache).

client.py (HiCacheClient: connection, breaker, the engine cycle's lookups and stores),
replies.py (what its answers become: Match, the plans), reports.py (the engine's reports
on them), retention.py (retention hints: pin, prioritize, unpin), hints.py (RetainHint),
connection.py, peer.py, deadlines.py, reconnect.py, prefill_rate.py, async_client.py,
engine_cache.py, hybrid_cache.py, keyed.py."""
