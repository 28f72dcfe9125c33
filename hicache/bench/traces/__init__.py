"""Trace replays: Mooncake-format traces, shipped or generated, against a real daemon and the radix index.

Modules:
  index_bench.py   Radix index replay of the Mooncake conversation trace.
  trace_bench.py   `hicache bench trace`: replay a Mooncake-format trace against a real daemon.
  trace_files.py   The trace files the benches replay: the default one shipped in the package.
  trace_remote.py  `bench trace --remote`: the remote tier under the trace replay.
  workloads.py     Generated traces in the Mooncake format (`input_length`, `hash_ids`).
"""
