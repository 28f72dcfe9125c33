"""disk_bench runs end to end on a tiny workload and prints every row it promises
(its numbers are not checked here: performance is measured by running it)."""

from __future__ import annotations

import math
import os

from hicache.bench.tiers import disk_baselines, disk_bench


def test_disk_bench_rows_on_a_tiny_workload(tmp_path):
    rows = disk_bench.run(sizes=(16 << 10, 64 << 10), total_bytes=1 << 20, workdir=str(tmp_path), repeats=1,
                          durabilities=("none", "batch"), rebuild_records=0)
    names = {r["name"] for r in rows}
    for label in ("16KiB", "64KiB"):
        for name in (f"put_{label}_none_tier_vs_raw_lmdb", f"get_warm_{label}_tier_vs_raw_lmdb",
                     f"get_cold_{label}_tier_vs_raw_lmdb", f"get_cold_{label}_tier_vs_dd_read",
                     f"get_cold_{label}_tier_vs_random_pread", f"get_cold_{label}_prefetch_vs_dd_read",
                     f"get_cold_{label}_prefetch_vs_seq_pread", f"get_cold_{label}_seq_pread_vs_dd_read",
                     f"get_cold_{label}_prefetch_vs_chain_pread", f"get_cold_{label}_chain_pread_vs_dd_read"):
            assert name in names
    assert "put_1024KiB_durability_batch_vs_none" in names
    for r in rows:
        assert r["value"] > 0 and r["ratio"] is not None and r["ratio"] > 0, r
    cold = next(r for r in rows if r["name"] == "get_cold_16KiB_tier_vs_raw_lmdb")
    assert all(0 <= f <= 1 for f in cold["resident_after_drop"])


def test_resident_fraction_sees_a_file_leave_the_page_cache(tmp_path):
    path = tmp_path / "data.mdb"
    path.write_bytes(os.urandom(1 << 20))
    assert disk_baselines.resident_fraction(str(path)) == 1.0  # just written: cached
    left = disk_baselines.drop_cache(str(tmp_path))
    assert not math.isnan(left) and left < 1.0
