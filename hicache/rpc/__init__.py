"""hicache.rpc: framing, protocol constants and the asyncio server transport."""
