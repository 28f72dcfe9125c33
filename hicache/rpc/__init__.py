"""hicache.rpc: framing, protocol constants and the server (dispatch and limits; a C frame loop, asyncio
without it).

Modules:
  connection.py   A daemon connection: one peer's frames in, replies and events out, within its limits.
  framing.py      Frames: a 4-byte big-endian length, then one msgpack map.
  native_conn.py  The daemon's connections served by a native (C) frame loop.
  peers.py        Who is on the other end of a daemon connection.
  protocol.py     Wire protocol: version, method names and stable error codes.
  server.py       The daemon's side of the socket: the listener, its frame loop, and the limits over all...
"""
