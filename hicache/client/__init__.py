"""hicache.client: the engine-side library (RPC connection, EngineCache).

client.py (HiCacheClient: connection, breaker, late answers), cycle.py (the engine
cycle's lookups and stores), asks.py (calls answered later: vLLM's scheduler),
slabs.py (the namespace's host slabs mapped here), replies.py (what its answers become:
Match, the plans), reports.py (the engine's reports on them), retention.py (retention
hints: pin, prioritize, unpin), hints.py (RetainHint), connection.py (the RPC connection:
waited, sent and posted calls), ledger.py (the answers it is owed), late.py (what a late
answer gives back), socket_io.py (its socket's reads and writes), peer.py, deadlines.py,
reconnect.py, prefill_rate.py, async_client.py, engine_cache.py, hybrid_cache.py, keyed.py."""

# The names an engine imports, reachable as ``from hicache.client import HiCacheClient``.
# Resolved on first use: the daemon and the CLI import submodules of this package
# (connection, peer) and must not pay for the client's imports.
_EXPORTS = {"HiCacheClient": "hicache.client.client", "RetainHint": "hicache.client.hints"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
