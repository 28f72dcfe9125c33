"""The capacity is the file: a tier opened with map_size == capacity (as the daemon opens
it) is filled to several times its size through an owner's LRU eviction hook, at page
sizes from 768 B (records inline in the B-tree, 2.5x their bytes) to 1 MiB (overflow
pages). Every put is accepted, LMDB never answers MDB_MAP_FULL, the file never grows
past the capacity (allocated blocks included) and what is read back is what was stored."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest

from hicache.tiers.disk.config import DiskTierConfig
from hicache.tiers.disk.tier import DiskTier
from tests.wait import wait_until

MiB = 1 << 20
SALT = bytes(range(16))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"m" * 12


def page(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


class LruOwner:
    """What the daemon's index does for the tier: remember stored pages, hand out the oldest."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.lock = threading.Lock()
        self.stored: deque[bytes] = deque()
        self.failed: list[bytes] = []

    def on_done(self, k: bytes, ok: bool) -> None:
        with self.lock:
            (self.stored if ok else self.failed).append(k)

    def evict(self, bytes_needed: int) -> list[bytes]:
        with self.lock:
            n = min(len(self.stored), -(-bytes_needed // self.page_bytes))
            return [self.stored.popleft() for _ in range(n)]


@pytest.mark.parametrize("page_bytes,tokens", [(768, 16), (64 << 10, 512), (MiB, 16)])
def test_filling_past_the_capacity_never_grows_the_file_nor_fills_the_map(tmp_path, page_bytes, tokens):
    capacity = 24 * MiB
    owner = LruOwner(page_bytes)
    tier = DiskTier.open(tmp_path / "disk", capacity, map_size=capacity, evict_hook=owner.evict)
    data = tmp_path / "disk" / "data.mdb"
    try:
        n = 4 * capacity // page_bytes  # four times what the file could hold
        for i in range(n):
            toks = np.arange(i * tokens, (i + 1) * tokens, dtype=np.int32)
            while not tier.put_async(SALT, key(i), None, toks, page(i, page_bytes), owner.on_done):
                assert tier.flush(timeout_s=60)  # the queue is full: let the writer catch up
            if i % 512 == 0:
                assert data.stat().st_size <= capacity
        assert tier.flush(timeout_s=120)
        st = tier.stats()
        assert owner.failed == [] and st["rejected_budget"] == 0
        assert st["write_errors"] == 0 and st["rejected_errors"] == 0  # never MDB_MAP_FULL
        assert st["evicted_pages"] > 0 and st["num_pages"] == len(owner.stored)
        assert st["map_bytes"] <= capacity and st["used_bytes"] <= capacity
        assert data.stat().st_size == capacity and data.stat().st_blocks * 512 <= capacity
        out = np.empty(page_bytes, np.uint8)
        last = int.from_bytes(owner.stored[-1][:4], "big")
        first = int.from_bytes(owner.stored[0][:4], "big")
        for i in (first, last):
            assert tier.get_into(SALT, key(i), out) and np.array_equal(out, page(i, page_bytes))
        # the budget is not a token one: most of the file holds pages
        assert st["used_bytes"] > capacity // (4 if page_bytes < 4096 else 2)
    finally:
        tier.close()


@pytest.mark.parametrize("native", [True, False], ids=["c_loop", "python_loop"])
def test_one_put_transactions_between_batches_never_fill_the_map(tmp_path, native):
    """How a loaded machine batches the queue, made deterministic: stretches of one-put
    transactions (each waits for its answer), then batches of 21 pages of 64 KiB (one
    transaction each). The one-put transactions' B-tree page copies cut the 17-page runs
    that evictions free; the batches need 21 such runs. The writer must see the free
    pages that are too scattered (disk/freelist.py) and evict or wait instead of
    meeting MDB_MAP_FULL (it did, every time, with a fixed 1/16 reserve)."""
    page_bytes, tokens, capacity = 64 << 10, 512, 24 * MiB
    owner = LruOwner(page_bytes)
    answered = [0]

    def on_done(k: bytes, ok: bool) -> None:
        owner.on_done(k, ok)
        answered[0] += 1

    tier = DiskTier.open(tmp_path / "disk", capacity, map_size=capacity, evict_hook=owner.evict,
                         config=DiskTierConfig(native_writer=native))
    try:
        i = 0
        for _ in range(10):
            for _ in range(30):  # 30 transactions of one put
                toks = np.arange(i * tokens, (i + 1) * tokens, dtype=np.int32)
                assert tier.put_async(SALT, key(i), None, toks, page(i, page_bytes), on_done)
                i += 1
                wait_until(lambda: answered[0] == i, 60, "the put's answer")
            for _ in range(3):  # 3 transactions of 21 puts
                keys = [key(j) for j in range(i, i + 21)]
                pages = np.stack([page(j, page_bytes) for j in range(i, i + 21)])
                toks = np.arange(i * tokens, (i + 21) * tokens, dtype=np.int32)
                assert tier.put_many_async(SALT, keys, None, toks, pages, lambda oks, keys=keys: [
                    on_done(k, ok) for k, ok in zip(keys, oks)], chained=False) == 21
                i += 21
                wait_until(lambda: answered[0] == i, 60, "the batch's answer")
        st = tier.stats()
        assert st["write_errors"] == 0 and st["rejected_errors"] == 0  # never MDB_MAP_FULL
        assert owner.failed == [] and st["rejected_budget"] == 0
        assert st["evicted_pages"] > 0 and st["num_pages"] == len(owner.stored)
        out = np.empty(page_bytes, np.uint8)
        last = int.from_bytes(owner.stored[-1][:4], "big")
        assert tier.get_into(SALT, key(last), out) and np.array_equal(out, page(last, page_bytes))
    finally:
        tier.close()
