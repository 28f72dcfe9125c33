"""The multi-turn bench's infinite-cache bound, by hand, and its row in a short run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from hicache.bench.engines.multiturn_bench import infinite_prefill


def test_infinite_prefill_reuses_whole_pages_of_prompts_and_answers():
    # page size 2. Request 1: prompt 1 2 3 4 5, answer 6 7 -> kept 1..6: pages 12 34 56.
    # Request 2 extends it: 1..7 then 8 9: lookup covers 1..8 -> pages 12 34 56 hit (6 tokens),
    # page 78 was never kept (7 was the last generated token) -> 9 - 6 = 3 computed.
    # Request 3 shares only page 12 (then differs): 5 - 2 = 3 computed.
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 9, 9, 9]]
    outputs = [[6, 7], [10], [11, 12]]
    assert infinite_prefill(prompts, outputs, 2) == [5, 3, 3]


def test_a_repeated_prompt_still_computes_its_last_page():
    # the lookup stops before the last token, so a fully cached prompt recomputes the rest of it
    assert infinite_prefill([[1, 2, 3, 4], [1, 2, 3, 4]], [[5], [5]], 2) == [4, 2]


def test_multiturn_bench_reports_prefill_against_the_infinite_cache(tmp_path):
    plot = importlib.util.find_spec("matplotlib") is not None or bool(os.environ.get("CI"))  # setup installs it
    chart = tmp_path / "multiturn.png"
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "multiturn", "--json", "--conversations", "3",
                          "--turns", "2", *(["--plot", str(chart)] if plot else [])],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if plot:  # the chart of this run: prefill and TTFT per setup
        from PIL import Image

        with Image.open(chart) as im:
            assert im.format == "PNG" and im.size[0] > 300
    rows = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    bound = rows["infinite cache: prefill tokens computed"]
    no_cache = rows["no cache: prefill tokens computed"]["value"]
    assert 0 < bound["value"] < no_cache and bound["baseline"] == no_cache
    for setup in ("device", "device+host", "device+host+disk"):
        r = rows[f"{setup}: prefill tokens computed vs infinite cache"]
        assert r["baseline"] == bound["value"] and r["value"] >= r["baseline"]
        assert r["ratio"] >= 1
