"""`hicache bench blockcopy` through the command line, on a tiny KV shape: its rows,
both copy methods, paired ratios to memcpy (performance is not asserted)."""

from __future__ import annotations

import json

from hicache.cli import main


def test_blockcopy_rows_for_each_dtype_and_method(capsys):
    assert main(["bench", "blockcopy", "--json", "--layers", "2", "--kv-heads", "2", "--head-size", "16",
                 "--block-size", "8", "--target-mib", "1", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "blockcopy"
    names = [r["name"] for r in out["results"]]
    assert names == [name for dtype in ("float32", "bfloat16")
                     for name in (f"save all layers {dtype} native", f"save all layers {dtype} torch",
                                  f"load per layer {dtype} native", f"load per layer {dtype} torch",
                                  f"save, first touch {dtype} native")]
    for r in out["results"]:
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0
        assert r["baseline_name"] == "memcpy" and 0 < r["ratio_min"] <= r["ratio"] and r["repeats"] == 2
