"""`hicache bench trace` end to end on a short trace: hicache's rows next to the simulated bounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "hicache.cli"]


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """Forty requests of four conversations under one 2-block system prompt, each turn
    extending the last: plenty of reuse, 512-token blocks."""
    reqs = []
    convs = {c: [0, 1, 100 + 10 * c] for c in range(4)}
    for turn in range(10):
        for c in range(4):
            convs[c] = convs[c] + [1000 + 100 * c + turn]
            reqs.append({"timestamp": 0, "input_length": 512 * len(convs[c]) + 7, "output_length": 8,
                         "hash_ids": convs[c] + [9999]})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def bench(*args: str) -> dict[str, dict]:
    out = subprocess.run([*CLI, "bench", "trace", "--json", *args], check=False, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return {r["name"]: r for r in json.loads(out.stdout)["results"]}


def test_trace_bench_reports_opt_lru_and_infinite_next_to_hicache(small_trace):
    rows = bench("--trace", str(small_trace), "--limit", "40", "--device-pages", "32",
                 "--host-capacity", "1MiB", "--disk-capacity", "2MiB", "--sim-fractions", "0.5")
    ours = rows["hit rate, all tiers"]
    assert ours["baseline_name"] == "infinite cache" and 0 < ours["value"] <= ours["baseline"]
    assert rows["sim infinite cache: hit rate"]["value"] == pytest.approx(ours["baseline"])
    vs_opt = rows["hit rate, all tiers vs OPT @ all tiers"]
    assert vs_opt["baseline"] == rows["sim @ all tiers: OPT hit rate"]["value"]
    assert vs_opt["ratio"] == pytest.approx(ours["value"] / vs_opt["baseline"])
    assert rows["sim @ host tier: capacity"]["value"] == 16  # 1 MiB of 64 KiB pages
    assert rows["sim @ all tiers: capacity"]["value"] == 48
    for label in ("host tier", "all tiers", "0.5 of unique"):
        opt = rows[f"sim @ {label}: OPT hit rate"]
        assert opt["value"] <= opt["baseline"]  # never above the infinite cache
        for name in ("LRU", "SLRU", "S3-FIFO", "ARC", "LFU-aging"):
            r = rows[f"sim @ {label}: {name} hit rate"]
            assert r["baseline_name"] == "OPT" and r["value"] <= r["baseline"]
    assert "hit rate, device + host vs OPT @ host tier" in rows
    assert rows["requests skipped (longer than the device pool)"]["value"] == 0
    fre = rows["sim @ 0.5 of unique: frecency vs best online (LRU)"] if (
        "sim @ 0.5 of unique: frecency vs best online (LRU)" in rows) else next(
        r for n, r in rows.items() if n.startswith("sim @ 0.5 of unique: frecency vs best online"))
    assert fre["value"] == rows["sim @ 0.5 of unique: frecency hit rate"]["value"]


def test_trace_replay_is_deterministic_and_skips_nothing_that_fits(small_trace, tmp_path):
    """The conversations plus one-shot 20-block documents through a 24-page pool, pages
    held by backups and all: nothing is skipped, and two replays (each its own daemon)
    hit exactly the same pages; a 60-block request cannot fit and is the one skipped."""
    reqs = [json.loads(line) for line in small_trace.read_text().splitlines()]
    for d in range(4):
        reqs.insert(8 * d + 3, {"timestamp": 0, "input_length": 512 * 20 + 3, "output_length": 8,
                                "hash_ids": list(range(5000 + 100 * d, 5021 + 100 * d))})
    reqs.append({"timestamp": 0, "input_length": 512 * 60, "output_length": 8, "hash_ids": list(range(7000, 7060))})
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    args = ("--trace", str(trace), "--device-pages", "24", "--host-capacity", "1MiB",
            "--disk-capacity", "8MiB", "--sim-fractions")  # a disk the map's headroom never binds
    first, second = bench(*args), bench(*args, "--eviction-policy", "frecency")
    assert first["requests skipped (longer than the device pool)"]["value"] == 1
    for tier in ("device", "host", "disk"):
        assert first[f"hit rate, {tier}"]["value"] == second[f"hit rate, {tier}"]["value"]
    assert first["hit rate, device"]["value"] + first["hit rate, host"]["value"] > 0
    assert first["hit rate, disk"]["value"] > 0  # the disk tier serves part of it


def test_trace_bench_sim_only_needs_no_daemon(small_trace):
    rows = bench("--trace", str(small_trace), "--sim-only", "--sim-fractions", "0.2", "1.0")
    assert rows["requests"]["value"] == 40
    assert "hit rate, all tiers" not in rows
    full = rows["sim @ 1 of unique: OPT hit rate"]
    assert full["value"] == pytest.approx(rows["sim infinite cache: hit rate"]["value"])
    assert rows["sim @ 0.2 of unique: LRU hit rate"]["value"] < full["value"]


def test_trace_bench_generated_workload():
    rows = bench("--workload", "rag", "--limit", "500", "--sim-only", "--sim-fractions", "0.1")
    assert rows["requests"]["value"] == 500
    opt = rows["sim @ 0.1 of unique: OPT hit rate"]
    assert rows["sim @ 0.1 of unique: LRU hit rate"]["value"] < opt["value"] <= opt["baseline"]


def test_trace_bench_reports_disk_writes_per_hit_and_the_ablation(small_trace):
    rows = bench("--trace", str(small_trace), "--device-pages", "24", "--host-capacity", "1MiB",
                 "--disk-capacity", "2MiB", "--sim-fractions", "--ablation-fractions", "0.4",
                 "--disk-placement", "non-inclusive")
    written = rows["disk pages written"]
    assert written["placement"] == "non-inclusive" and written["admission"] == "reuse"
    hits = rows["hit rate, disk"]["value"] * rows["prompt tokens"]["value"] / 512
    assert rows["disk pages written per disk hit"]["value"] == pytest.approx(written["value"] / max(1, round(hits)))
    before = rows["tiers @ 0.4 of unique: inclusive, admit all (before): disk writes per disk hit"]
    assert before["ratio"] == 1
    for name in ("exclusive + admission", "non-inclusive + admission (hicache)", "less admit-while-room"):
        r = rows[f"tiers @ 0.4 of unique: {name}: hit rate"]
        assert r["baseline_name"] == "LRU" and 0 <= r["value"] <= 1


def test_trace_bench_signals_and_device_host_placement_rows(small_trace):
    """`--signals` adds each structure signal next to LRU and OPT of the same run; the
    ablation carries the device-host placements (exclusive is one LRU of both pools)."""
    rows = bench("--trace", str(small_trace), "--sim-only", "--sim-fractions", "0.4", "--ablation-fractions", "0.4",
                 "--signals")
    lru, opt = rows["sim @ 0.4 of unique: LRU hit rate"]["value"], rows["sim @ 0.4 of unique: OPT hit rate"]["value"]
    assert rows["signals @ 0.4 of unique: LRU: hit rate"]["value"] == lru
    for name in ("LRU + depth", "LRU + fan-out", "frecency + relative depth"):
        r = rows[f"signals @ 0.4 of unique: {name}: hit rate"]
        assert r["baseline"] == lru and r["opt"] == opt and 0 < r["value"] <= opt
    for placement in ("inclusive", "exclusive", "non-inclusive"):
        assert 0 < rows[f"device-host @ 0.4 of unique: {placement}: hit rate"]["value"] <= opt
        assert rows[f"device-host @ 0.4 of unique: {placement}: pages copied"]["baseline_name"] == "inclusive"
    assert rows["device-host @ 0.4 of unique: exclusive: hit rate"]["value"] == pytest.approx(lru)
    assert not any(n.startswith("signals @") for n in bench("--trace", str(small_trace), "--sim-only",
                                                              "--sim-fractions", "--ablation-fractions", "0.4"))


def test_trace_bench_reports_remote_writes_per_remote_hit_with_and_without_admission(tmp_path):
    """A generated chat trace through a 16-page host and a small Redis as the remote tier (no
    disk), replayed per remote admission mode: the remote tier serves what the host lost, and
    its writes per hit are reported against admit-all's in the same run."""
    from hicache.bench.procs.redis_procs import redis_server_binary

    if redis_server_binary() is None:
        import os

        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("bench trace --remote needs redis-server; CI must install it (scripts/setup.sh)")
        pytest.skip("bench trace --remote needs redis-server")
    rows = bench("--workload", "chat", "--limit", "120", "--device-pages", "32", "--host-capacity", "1MiB",
                 "--disk-capacity", "0", "--remote", "--remote-capacity", "4MiB", "--sim-fractions",
                 "--ablation-fractions")
    for mode in ("all", "reuse"):
        hits = rows[f"remote admission {mode}: remote hit pages"]["value"]
        written = rows[f"remote admission {mode}: remote pages written"]["value"]
        per_hit = rows[f"remote admission {mode}: remote pages written per remote hit"]
        assert hits > 0 and written > 0 and per_hit["value"] == pytest.approx(written / hits)
        assert per_hit["baseline_name"] == "all"
        by_bytes = rows[f"remote admission {mode}: remote bytes written per remote hit"]["value"]
        assert by_bytes > per_hit["value"] * 64 * 1024  # a record is its page and a header
    assert rows["remote admission all: remote pages written per remote hit"]["ratio"] == 1
