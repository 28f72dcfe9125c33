"""Benchmarks behind `hicache bench NAME`: every figure next to a baseline measured in the same run."""
