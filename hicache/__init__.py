"""hicache: a tiered KV-cache daemon (device -> pinned host arena -> LMDB disk)."""

from hicache.errors import HiCacheError
from hicache.layout import KVLayout

__all__ = ["HiCacheError", "KVLayout", "__version__"]
__version__ = "0.1.0"
