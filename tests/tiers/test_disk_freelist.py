"""LMDB's free list as the disk writer reads it (hicache/tiers/disk/freelist.py): the pages
a deletion frees show up as one run once the next write transaction may reuse them."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

from hicache.tiers.disk.freelist import open_free_list


def _runs(pages: np.ndarray) -> list[int]:
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    return np.diff(np.concatenate(([0], breaks, [len(pages)]))).tolist() if len(pages) else []


def test_a_deleted_overflow_value_is_one_run_of_free_pages_two_commits_later(tmp_path):
    env = lmdb.open(str(tmp_path / "db"), map_size=16 << 20)
    free_list = open_free_list(env)
    if free_list is None:
        pytest.skip("this py-lmdb does not expose the functions the free list reader uses")
    try:
        with env.begin(write=True) as txn:
            for i in range(3):
                txn.put(b"k%d" % i, bytes([i]) * (9 * 4096))  # 10 overflow pages each
        with env.begin(write=True) as txn:
            txn.delete(b"k1")  # transaction T frees k1's 10 pages
        with env.begin() as txn:  # the next writer is T+1: T's pages are not reusable yet
            assert max(_runs(free_list.pages(txn)), default=0) < 10
        with env.begin(write=True) as txn:
            txn.put(b"tick", b"1")  # T+1
        with env.begin() as txn:  # the next writer is T+2: it may reuse them
            pages = free_list.pages(txn)
            assert max(_runs(pages)) >= 10 and np.all(np.diff(pages.astype(np.int64)) > 0)
            assert free_list.fragment_pages(txn, 1000) == len(pages)  # every run is shorter
            assert free_list.fragment_pages(txn, 10) == sum(n for n in _runs(pages) if n < 10)
            assert free_list.fragment_pages(txn, 1) == 0
        with env.begin(write=True) as txn:
            txn.put(b"k3", b"x" * (9 * 4096))  # takes the run
        with env.begin(write=True) as txn:
            txn.put(b"tick", b"2")
        with env.begin() as txn:
            assert max(_runs(free_list.pages(txn)), default=0) < 10
    finally:
        env.close()
