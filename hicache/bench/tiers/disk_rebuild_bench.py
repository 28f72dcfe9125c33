"""The disk tier's start-up rebuild, timed for disk_bench (hicache/bench/tiers/disk_bench.py):
``iter_meta`` over n records after a reopen, and the daemon's whole rebuild of the
radix index from them. Rows against a 10 s baseline (lower is better).
"""

from __future__ import annotations

import gc
import shutil
import threading
import time

import numpy as np

from hicache.bench.tiers.disk_baselines import fresh_dir, result_row
from hicache.tiers.disk.tier import DiskTier, DiskTierConfig


def iter_meta_row(path: str, salt: bytes, n: int, config: DiskTierConfig) -> dict:
    """``iter_meta`` after a reopen, over n records of 64-byte pages in chains of 64."""
    fresh_dir(path)
    page = np.arange(64, dtype=np.uint8)  # 64-byte pages: the metadata is what is timed
    tokens = np.arange(64, dtype=np.int32)
    parent = None
    t0 = time.perf_counter()
    # the budget counts page bytes only; ~400 B of record + B-tree per page need map room
    map_size = n * 1024 + (64 << 20)
    with DiskTier.open(path, n * 64 + 64, map_size=map_size, config=config) as tier:
        room = threading.Semaphore(config.max_queue_pages)
        for i in range(n):
            key = i.to_bytes(8, "big") + salt[:8]
            room.acquire()
            tier.put_async(salt, key, parent, tokens, page, lambda k, ok: room.release())
            parent = key if i % 64 else None  # chains of 64 pages
        tier.flush()
    write_s = time.perf_counter() - t0
    with DiskTier.open(path, n * 64 + 64, map_size=map_size, config=config) as tier:
        t0 = time.perf_counter()
        count = ntok = 0
        for rec in tier.iter_meta():
            count += 1
            ntok += len(rec.tokens)
        iter_s = time.perf_counter() - t0
    shutil.rmtree(path)
    if count != n:
        raise RuntimeError(f"iter_meta returned {count} of {n} records")
    row = result_row(f"iter_meta_{n}_records", iter_s, "s", 10.0)
    row["write_s"] = round(write_s, 2)
    return row


def index_rebuild_row(path: str, n: int, config: DiskTierConfig | None = None) -> dict:
    """The daemon's whole startup rebuild for n pages: iter_meta, then the radix
    index's restore_disk (which re-derives every key from its parent and tokens).
    Real chained keys, 16-token pages of 64 bytes, sequences of 64 pages."""
    from hicache.index.keys import page_keys
    from hicache.index.radix import RadixIndex

    config = config or DiskTierConfig()
    fresh_dir(path)
    salt = bytes(range(16))
    ps, chain = 16, 64
    page = np.arange(64, dtype=np.uint8)
    map_size = n * 1024 + (64 << 20)
    rng = np.random.default_rng(0)
    with DiskTier.open(path, n * 64 + 64, map_size=map_size, config=config) as tier:
        room = threading.Semaphore(config.max_queue_pages)
        for _ in range(n // chain):
            toks = rng.integers(0, 1 << 20, ps * chain, dtype=np.int32)
            parent = None
            for i, key in enumerate(page_keys(salt, toks, ps)):
                room.acquire()
                tier.put_async(salt, key, parent, toks[i * ps:(i + 1) * ps], page, lambda k, ok: room.release())
                parent = key
        tier.flush()
    with DiskTier.open(path, n * 64 + 64, map_size=map_size, config=config) as tier:
        t0 = time.perf_counter()
        gc.disable()  # as the daemon's rebuild does (hicache/daemon/movers/disk_mover.py)
        try:
            records = [(r.key, r.parent_key if r.parent_key is not None else r.salt, r.tokens, r.last_access)
                       for r in tier.iter_meta()]
        finally:
            gc.enable()
        iter_s = time.perf_counter() - t0
        index = RadixIndex(ps, salt)
        restored = index.restore_disk(records)
        total_s = time.perf_counter() - t0
    shutil.rmtree(path)
    if restored != (n // chain) * chain:
        raise RuntimeError(f"restored {restored} of {n} pages")
    return result_row(f"index_rebuild_{restored}_pages", total_s, "s", 10.0) | {"iter_meta_s": round(iter_s, 2)}

