"""hicache: a tiered KV-cache daemon (device -> pinned host arena -> LMDB disk).

Modules:
  bench/           Benchmarks behind `hicache bench NAME`.
  cli/             The `hicache` command line: `python -m hicache.cli` and the `hicache` entry point run...
  client/          hicache.client: the engine-side library (RPC connection, EngineCache).
  config/          Daemon configuration: embedded defaults < TOML file < HICACHE_* variables < flags.
  cpu_list.py      CPU lists as Linux writes them (`0-3,8`, `cpuset` and `taskset -c` style).
  daemon/          The hicache daemon: one sub-package per concern, imports flowing downwards.
  data/            Package data: the systemd units, the benches' default trace and its licence.
  engine/          The reference engine: a tiny transformer with paged attention, and its runner.
  errors.py        The error tree.
  index/           hicache.index: what the daemon knows of the pages of each namespace.
  integrations/    Adapters that let real inference engines use hicache as the tier below their own device...
  kernels/         Copy and allocation kernels: Triton kernels with torch twins, DMA page-run copies.
  layout.py        KVLayout: the geometry of one model's KV cache, and the byte layout of a page.
  portable/        Portable export files: one namespace's disk tier as a self-checking stream.
  progress.py      Progress lines for long CLI operations (export, import, bench runs).
  rpc/             hicache.rpc: framing, protocol constants and the server.
  state_layout.py  StateLayout: the geometry of a hybrid model's recurrent state, and the bytes of a checkpoint.
  systemd/         systemd integration: readiness and watchdog notifications, socket activation.
  tiers/           The storage tiers, one sub-package each: device, host (L2), disk (L3), remote (L4).
  transfer/        Moving KV between the device pool and the host arena.
"""

from hicache.errors import HiCacheError
from hicache.layout import KVLayout

__all__ = ["HiCacheError", "KVLayout", "__version__"]
__version__ = "0.1.0"
