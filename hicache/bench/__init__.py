"""Benchmarks behind `hicache bench NAME`: every figure next to a baseline measured in the same run.

Modules:
  cli.py     `hicache bench NAME`: argument parsing and dispatch for every benchmark.
  daemon/    One daemon at production size and under sustained load: memory and CPU next to redis-server.
  engines/   Real inference engines serving through hicache: vLLM, SGLang, the reference engine.
  plot.py    Charts of benchmark results (`--plot FILE`, `hicache bench plot RESULTS.json FILE`).
  policy/    What the cache keeps: policies simulated on a trace's block sequence.
  procs/     Peer processes the benchmarks and tests launch: redis-server, a Mooncake master, an SGLang server.
  report.py  Result rows and how `hicache bench` prints them.
  rpc/       The RPC path: round trips against native echo servers, the handlers' CPU.
  tiers/     Each tier's and each copy path's throughput against a raw baseline measured beside it.
  traces/    Trace replays: Mooncake-format traces, shipped or generated.
"""
