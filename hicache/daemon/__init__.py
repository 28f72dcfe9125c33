"""hicache.daemon: the asyncio daemon (lifecycle, RPC handlers, tier movers)."""
