"""The RPC path: round trips against native echo servers, the handlers' CPU, each native path against its
Python fallback.

Modules:
  handler_bench.py  `hicache bench rpc --calls handlers`: the daemon's CPU for one `match` + `release`.
  native_bench.py   `hicache bench native`: each native path against its Python fallback, in one run.
  native_echo.py    Native echo servers with hicache's framing.
  rpc_bench.py      `hicache bench rpc`: match / insert round trips for an 8K-token prompt.
"""
