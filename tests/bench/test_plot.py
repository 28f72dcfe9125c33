"""Charts of bench results: `--plot FILE` on a real run, `hicache bench plot` from its JSON,
and the one-line errors when matplotlib is missing or the input is not a bench's output.
Under CI=true matplotlib must be there (scripts/setup.sh installs the plot extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hicache.bench.plot import multiturn_setups, trace_series

if not os.environ.get("CI"):
    pytest.importorskip("matplotlib")

CLI = [sys.executable, "-m", "hicache.cli"]
REPO = Path(__file__).resolve().parents[2]


def hicache(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s)


def assert_png(path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


def test_trace_replay_draws_hit_rate_against_capacity_with_the_daemons_points(tmp_path):
    chart = tmp_path / "trace.png"
    out = hicache("bench", "trace", "--json", "--workload", "chat", "--limit", "30", "--device-pages", "16",
                  "--host-capacity", "1MiB", "--disk-capacity", "2MiB", "--sim-fractions", "0.1", "0.5",
                  "--plot", str(chart))
    assert out.returncode == 0, out.stderr
    series, replay, infinite = trace_series(json.loads(out.stdout)["results"])
    # OPT, LRU and hicache's policy at both tier capacities and both fractions; the real
    # daemon's two points (device + host, all tiers)
    assert {"OPT", "LRU", "frecency"} <= series.keys() and all(len(p) == 4 for p in series.values())
    assert [who for who, _, _ in replay] == ["device + host", "all tiers"]
    assert 0 < infinite <= 1
    assert_png(chart)


def test_bench_plot_redraws_a_saved_json_and_refuses_what_is_not_one(tmp_path):
    results = tmp_path / "trace.json"
    out = hicache("bench", "trace", "--json", "--sim-only", "--workload", "agent", "--limit", "150",
                  "--sim-fractions", "0.2", "0.6")
    assert out.returncode == 0, out.stderr
    results.write_text(out.stdout)
    chart = tmp_path / "trace.png"
    done = hicache("bench", "plot", str(results), str(chart), "--title", "agent workload")
    assert done.returncode == 0, done.stderr
    assert_png(chart)
    svg = tmp_path / "trace.svg"
    assert hicache("bench", "plot", str(results), str(svg)).returncode == 0
    assert ET.parse(svg).getroot().tag.endswith("svg")
    bad = tmp_path / "not-results.json"
    bad.write_text('{"hello": 1}\n')
    r = hicache("bench", "plot", str(bad), str(tmp_path / "x.png"))
    assert r.returncode == 1 and "not the output of `hicache bench" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_plot_fails_at_once_with_the_fix(tmp_path):
    # matplotlib made unimportable in this process only: the stand-in for an install without the extra
    code = ("import sys; sys.modules['matplotlib'] = None; from hicache.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "bench", "trace", "--sim-only", "--workload", "chat",
                        "--plot", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    assert r.stderr.strip() == "hicache: charts need matplotlib: pip install 'hicache[plot]'"
    assert r.stdout == ""  # refused before the bench ran


def test_a_chart_name_without_png_or_svg_is_refused_before_the_run(tmp_path):
    r = hicache("bench", "trace", "--sim-only", "--workload", "chat", "--plot", str(tmp_path / "chart.jpg"))
    assert r.returncode == 1 and "must end in .png or .svg" in r.stderr and r.stdout == ""


def test_multiturn_bars_are_the_setups_and_the_infinite_cache_is_a_line():
    rows = json.loads((REPO / "docs" / "img" / "bench-multiturn.json").read_text())["results"]
    assert multiturn_setups(rows) == ["no cache", "device", "device+host", "device+host+disk"]
