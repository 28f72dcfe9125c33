"""What the engine cycle refuses before it touches anything: malformed page keys, and
device page ids out of an engine's pool or repeated (BAD_PARAMS, nothing changed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.daemon.core.records import EngineRecord
from hicache.index.keys import PackedKeys
from hicache.rpc.protocol import Code, RpcError


def split_keys(blob: Any) -> PackedKeys:
    try:
        return PackedKeys(blob)
    except ValueError as e:
        raise RpcError(Code.BAD_PARAMS, str(e)) from None


def check_device_pages(rec: EngineRecord, pages: np.ndarray, n: int) -> None:
    if len(pages) != n:
        raise RpcError(Code.BAD_PARAMS, f"expected {n} device pages, got {len(pages)}")
    if n and (pages.min() < 1 or pages.max() > rec.device_pages):
        raise RpcError(Code.BAD_PARAMS, f"device pages must be in 1..{rec.device_pages}")
    if n > 1 and _repeats(pages, rec.device_pages):
        raise RpcError(Code.BAD_PARAMS, "device pages repeat")


def _repeats(pages: np.ndarray, pool_pages: int) -> bool:
    """Whether device page ids repeat. A count per id of the pool is cheapest for the
    pools engines have; for a request far smaller than a huge pool, sort instead of
    allocating a count per id."""
    if pool_pages <= 8 * len(pages) + 65536:
        return bool(np.bincount(pages).max() > 1)
    ordered = np.sort(pages)
    return bool((ordered[1:] == ordered[:-1]).any())
