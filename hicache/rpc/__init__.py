"""hicache.rpc: framing, protocol constants and the server (dispatch and limits; a C frame loop, asyncio without it)."""
