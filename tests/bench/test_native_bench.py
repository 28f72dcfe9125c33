"""`hicache bench native`, small: a row per native path with the Python figure over the native
one, in the shape the doctor reads (path, op, ratio); a path switched off is a NaN row
saying why; the shipped measurement is this bench's output."""

from __future__ import annotations

import math

import pytest

from hicache.bench.rpc import native_bench
from hicache.cli.doctor import measured_costs
from hicache.index import native_index


def test_a_row_per_native_path_python_over_native():
    rows = native_bench.run(index_pages=2048, requests=60, disk_pages=32, repeats=2)
    by_path: dict[str, list[dict]] = {}
    for r in rows:
        by_path.setdefault(r["path"], []).append(r)
    assert set(by_path) == set(native_bench.PATHS)
    if any("note" in r for r in rows):  # a module not built here: its rows say why
        missing = [r["note"] for r in rows if "note" in r]
        pytest.skip(f"native paths unavailable here: {missing}")
    assert [r["op"] for r in by_path["frame_loop"]] == ["match + release", "16K-token insert"]
    for r in rows:
        assert r["value"] > 0 and r["baseline"] > 0 and r["baseline_name"] == "native" and r["unit"] == "us"
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])


def test_a_path_switched_off_is_a_row_that_says_why(monkeypatch):
    monkeypatch.setattr(native_index.EXTENSION, "_loaded", [])
    monkeypatch.setenv("HICACHE_NATIVE_INDEX", "0")
    (r,) = native_bench.run(paths=("index",))
    assert math.isnan(r["value"]) and r["note"] == "native unavailable: disabled by HICACHE_NATIVE_INDEX=0"
    with pytest.raises(ValueError, match="unknown native paths"):
        native_bench.run(paths=("gpu",))


def test_the_shipped_costs_are_this_benchs_rows():
    costs = measured_costs()
    assert costs["bench"] == "native" and costs["date"] and costs["load_average"]
    assert {r["path"] for r in costs["results"]} == set(native_bench.PATHS)
    for r in costs["results"]:
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"]) and r["ratio"] > 0
