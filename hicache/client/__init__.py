"""hicache.client: the engine-side library (RPC connection, EngineCache)."""
