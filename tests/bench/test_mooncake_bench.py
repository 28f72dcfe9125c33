"""`hicache bench remote --backend mooncake`, small: every row has its same-run baseline
(raw Mooncake calls, the tier on Redis) and the pages came back unchanged (asserted in
the bench itself)."""

from __future__ import annotations

from hicache.bench.tiers.mooncake_bench import run
from tests.remote.conftest import _require_mooncake, _require_redis


def test_the_mooncake_bench_reports_ratios_to_raw_calls_and_to_redis():
    _require_mooncake()
    _require_redis()
    rows = run(None, (64,), 4, 1)
    baselines = {r["baseline_name"] for r in rows}
    assert {"raw batch_put_from", "raw batch_get_into", "redis tier put", "redis tier get",
            "redis tier probe"} <= baselines
    assert all(r["value"] > 0 and r["ratio"] > 0 for r in rows)
