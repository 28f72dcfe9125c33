"""The disk tier's read-ahead of long runs (hicache/tiers/disk_readahead.py) on real
LMDB environments: where the runs are, that hinting them reads them into the page
cache, and that batch reads with the hint on stay byte-exact and verified."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from hicache.bench.disk_bench import _drop_cache, _resident_fraction
from hicache.errors import ConfigError
from hicache.tiers import disk_readahead
from hicache.tiers.disk import DiskTierConfig
from tests.wait import wait_until
from tests.tiers.test_disk import MiB, SALT_A, key, open_tier, page_for, put_all  # noqa: F401 (fixture)

SIZE = 256 << 10


def _tier_with_chain(open_tier, n: int, **config):  # noqa: F811
    tier = open_tier(capacity=(n + 1) * SIZE, config=DiskTierConfig(**config))
    items = [(key(i), page_for(key(i), SIZE)) for i in range(n)]
    put_all(tier, items)
    return tier, items


def test_page_runs_finds_each_value_in_the_map_and_merges_a_chain(open_tier):  # noqa: F811
    tier, items = _tier_with_chain(open_tier, 24)
    keys = [k for k, _ in items]
    shuffled = [keys[i] for i in np.random.default_rng(0).permutation(len(keys))]
    with tier._env.begin(buffers=True) as txn:
        for k, pg in items[:3]:  # each single-key run is exactly that value's bytes in the map
            (lo, hi), = disk_readahead.page_runs(txn, tier._pages, [k])
            assert hi - lo == SIZE and ctypes.string_at(lo, SIZE) == pg.tobytes()
        runs = disk_readahead.page_runs(txn, tier._pages, shuffled + [key(999)])  # a missing key is skipped
        apart = disk_readahead.page_runs(txn, tier._pages, keys, max_gap=0)
    # pages put one after another: one run (B-tree pages in between are read along), in any key order
    assert len(runs) == 1 and 24 * SIZE <= runs[0][1] - runs[0][0] < 2 * 24 * SIZE
    assert len(apart) > 1 and sum(hi - lo for lo, hi in apart) == 24 * SIZE  # no gap allowed: value by value


def test_hinting_a_run_reads_it_into_the_page_cache(open_tier, tmp_path):  # noqa: F811
    tier, items = _tier_with_chain(open_tier, 32)
    data = str(tmp_path / "disk" / "data.mdb")
    tier.close()  # the writer's pages stay mapped (and cached) while it is open
    tier = open_tier(capacity=33 * SIZE)
    before = _drop_cache(str(tmp_path / "disk"))
    with tier._env.begin(buffers=True) as txn:
        runs = disk_readahead.page_runs(txn, tier._pages, [k for k, _ in items])
        (lo, hi), = runs
        assert disk_readahead.hint_runs(runs, min_bytes=hi - lo + 1) == 0  # shorter than asked: no hint
        assert disk_readahead.hint_runs(runs, min_bytes=SIZE) >= 32 * SIZE
    run_fraction = 32 * SIZE / os.path.getsize(data)
    # WILLNEED queues the reads and returns; wait for them to land
    wait_until(lambda: _resident_fraction(data) >= before + 0.9 * run_fraction, timeout_s=30,
               what="the hinted run in the page cache")


@pytest.mark.parametrize("run_bytes", [None, 0, SIZE])
def test_batch_reads_with_the_hint_are_byte_exact(open_tier, tmp_path, run_bytes):  # noqa: F811
    tier, items = _tier_with_chain(open_tier, 40, readahead_run_bytes=run_bytes)
    tier.close()
    tier = open_tier(capacity=41 * SIZE, config=DiskTierConfig(readahead_run_bytes=run_bytes))
    _drop_cache(str(tmp_path / "disk"))
    order = np.random.default_rng(1).permutation(len(items))
    keys = [items[i][0] for i in order] + [key(999)]
    outs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    hits = tier.get_many_async(SALT_A, keys, outs).result(timeout=60)
    assert hits == [True] * len(items) + [False]
    assert all(np.array_equal(outs[j], items[i][1]) for j, i in enumerate(order))
    assert tier.stats()["corrupt_pages"] == 0


def test_a_flipped_byte_in_a_hinted_run_is_a_counted_miss(open_tier, tmp_path):  # noqa: F811
    tier, items = _tier_with_chain(open_tier, 8, readahead_run_bytes=SIZE)
    tier.close()
    data_file = tmp_path / "disk" / "data.mdb"
    victim = items[5][1].tobytes()
    blob = data_file.read_bytes()
    at = blob.find(victim[:64]) + SIZE // 2
    assert at > SIZE // 2
    with open(data_file, "r+b") as f:
        f.seek(at)
        f.write(bytes([blob[at] ^ 0x01]))
    tier = open_tier(capacity=9 * SIZE, config=DiskTierConfig(readahead_run_bytes=SIZE))
    outs = [np.zeros(SIZE, dtype=np.uint8) for _ in items]
    hits = tier.get_many_async(SALT_A, [k for k, _ in items], outs).result(timeout=60)
    assert hits == [i != 5 for i in range(8)]
    assert all(np.array_equal(outs[i], pg) for i, (_, pg) in enumerate(items) if i != 5)
    assert tier.stats()["corrupt_pages"] == 1


def test_device_window_and_config():
    assert disk_readahead.device_window(".") >= 4096
    with pytest.raises(ConfigError):
        DiskTierConfig(readahead_run_bytes=-1)
