"""`hicache bench transfer` (CPU): its rows, ratios and the worst-row summary, on
a tiny layout (a smoke test of the bench's plumbing; performance is not asserted)."""

from __future__ import annotations

import json

from hicache.bench.tiers import transfer_bench


def test_rows_carry_paired_ratios_and_the_worst_row():
    rows = transfer_bench.run((4,), num_layers=2, num_kv_heads=2, head_dim=16, target_bytes=1 << 20,
                              repeats=3, threads=(1, 2))
    *copies, worst = rows
    assert [r["name"] for r in copies] == ["load_per_layer_ps4_t1", "backup_all_layer_ps4_t1",
                                           "load_per_layer_ps4_t2", "backup_all_layer_ps4_t2"]
    for r in copies:
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0
        assert 0 < r["ratio_min"] <= r["ratio"]
        assert r["repeats"] == 3
    assert copies[0]["ratio"] == copies[0]["ratio_same_threads"]  # one thread: one baseline
    low = min(copies, key=lambda r: r["ratio"])
    assert (worst["name"], worst["value"], worst["worst_row"]) == ("worst_ratio", low["ratio"], low["name"])


def test_main_prints_json_rows(capsys):
    transfer_bench.main(["--page-sizes", "4", "--repeats", "1", "--threads", "1", "--target-mib", "1", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == ["load_per_layer_ps4_t1", "backup_all_layer_ps4_t1", "worst_ratio"]
    assert {"name", "value", "unit", "baseline", "ratio"} <= rows[0].keys()
