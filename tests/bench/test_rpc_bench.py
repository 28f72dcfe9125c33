"""`hicache bench rpc` runs against a real daemon: the pipelined puts against the same puts
one by one, the daemon's CPU per call against the echo and redis servers', the in-process
handler stages, each measured in the same run."""

from __future__ import annotations

import shutil

from hicache.bench.rpc.rpc_bench import STEP_PUTS, run


def test_the_puts_rows_compare_pipelined_with_one_by_one():
    rows = run(prompt_tokens=64, requests=40, client_counts=(1,), repeats=1, calls=("puts",))
    assert [r["name"] for r in rows] == [f"{STEP_PUTS} puts of 64 tokens pipelined, 1 client p{q}" for q in (50, 99)]
    for r in rows:
        assert r["value"] > 0 and r["baseline"] > 0 and r["baseline_name"] == "one by one"


def test_the_handlers_rows_time_the_daemons_match_path_in_process_against_echo_frames():
    from hicache.bench.rpc.handler_bench import run as in_process

    rows = in_process(prompt_tokens=256, requests=50, repeats=2)
    assert [r["name"] for r in rows] == [
        "match + release handlers, 256 tokens, in-process",
        "match + release fast handlers (native frame loop), 256 tokens, in-process",
        "  of which CacheService match + release, 256 tokens, in-process",
        "  of which the radix walk (RadixIndex.match), 256 tokens, in-process"]
    assert rows[0]["baseline_name"] == "echo frames" and rows[0]["baseline"] > 0
    assert rows[1]["baseline_name"] == "handlers" and rows[1]["baseline"] == rows[0]["value"]
    for r in rows:
        assert r["value"] > 0 and 0 < r["best_us"] <= r["value"]


def test_a_match_run_reports_the_daemons_cpu_per_call_against_the_echo_servers():
    rows = run(prompt_tokens=256, requests=100, client_counts=(1, 2), repeats=1, calls=("match",))
    cpu = [r for r in rows if r["name"].endswith("daemon CPU per call + release")]
    assert [r["name"] for r in cpu] == [f"match 256 tokens, {n} daemon CPU per call + release"
                                        for n in ("1 client", "2 clients")]
    for r in cpu:  # a match and a release do more than echo a frame
        assert r["baseline_name"] == "echo server CPU per call" and 0 < r["baseline"] < r["value"]
    vs_redis = [r for r in rows if r.get("baseline_name") == "redis-server CPU per GET"]
    assert len(vs_redis) == (2 if shutil.which("redis-server") else 0)
    assert all(r["baseline"] > 0 and r["value"] == c["value"] for r, c in zip(vs_redis, cpu))
