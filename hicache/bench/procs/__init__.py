"""Peer processes the benchmarks and tests launch: redis-server, a Mooncake master, an SGLang server.

Modules:
  mooncake_procs.py  A local Mooncake Store for the remote-tier tests and benchmark: one `mooncake_master`.
  redis_procs.py     Local redis-server processes for the remote-tier tests and benchmark.
  sglang_server.py   A real SGLang server process (`python -m sglang.launch_server`) for `hicache bench...
"""
