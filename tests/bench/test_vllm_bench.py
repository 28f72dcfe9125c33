"""`hicache bench vllm --compare`: the workload, the arrival gaps, and a short real run of vLLM
alone vs hicache (each its own vLLM process, a real daemon) whose rows compare them, and the
refusal to compare runs whose outputs differ.

Under CI=true a missing vLLM fails the suite instead of skipping it.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import subprocess
import sys

import pytest

from hicache.bench.vllm_peers import parse_compare
from hicache.bench.vllm_workload import conversations, poisson_gaps

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def test_each_turn_resends_the_conversation_so_far():
    rounds = conversations(3, 3, system_tokens=10, user_tokens=4, reply_tokens=2)
    assert [len(r) for r in rounds] == [3, 3, 3]
    for c in range(3):
        assert rounds[0][c][:10] == rounds[0][0][:10]  # one shared system prompt
        assert len(rounds[0][c]) == 14
        for t in (1, 2):
            prev, cur = rounds[t - 1][c], rounds[t][c]
            assert cur[:len(prev)] == prev and len(cur) == len(prev) + 2 + 4  # reply, then a new user turn
    assert rounds[1][0][14:] != rounds[1][1][14:]  # conversations differ after the system prompt


def test_poisson_gaps_open_conversations_at_the_rate_and_think_between_turns():
    n, turns, rate = 2000, 3, 4.0
    gaps = poisson_gaps(n, turns, rate, seed=7)
    assert gaps == poisson_gaps(n, turns, rate, seed=7) != poisson_gaps(n, turns, rate, seed=8)
    assert all(len(g) == turns and min(g) > 0 for g in gaps)
    opens = [g[0] for g in gaps]
    assert opens == sorted(opens)  # a Poisson process: increasing arrival times
    between = [b - a for a, b in zip([0.0] + opens, opens, strict=False)]
    assert statistics.mean(between) == pytest.approx(1 / rate, rel=0.1)
    think = [x for g in gaps for x in g[1:]]
    assert statistics.mean(think) == pytest.approx(n / rate, rel=0.1)  # all conversations together: ~rate/s
    assert statistics.pstdev(think) == pytest.approx(n / rate, rel=0.15)  # exponential: sd = mean


@pytest.mark.parametrize("bad", [(0, 2, 1.0), (2, 0, 1.0), (2, 2, 0.0), (2, 2, -1.0)])
def test_poisson_gaps_refuse_bad_input(bad):
    with pytest.raises(ValueError):
        poisson_gaps(*bad)


def test_compare_names_are_checked_and_vllm_alone_comes_first():
    assert parse_compare("hicache") == ["none", "hicache"]
    assert parse_compare("lmcache,none,hicache") == ["none", "lmcache", "hicache"]
    for bad in ("hicache,redis", "hicache,hicache", ""):
        if bad:
            with pytest.raises(ValueError):
                parse_compare(bad)


def test_naming_lmcache_without_it_installed_exits_2_with_how_to_install(tmp_path):
    # sys.modules[name] = None is Python's own way to make a package unimportable
    code = ("import sys; sys.modules['lmcache'] = None; from hicache.cli import main; "
            "sys.exit(main(['bench', 'vllm', '--compare', 'none,lmcache', '--workdir', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "scripts/install_lmcache.sh" in lines[0]
    assert not list(tmp_path.iterdir())  # refused before building anything


def _tiny_args(workdir: str) -> argparse.Namespace:
    from hicache.bench.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "vllm", "--compare", "none,hicache", "--conversations", "2", "--turns", "2",
                              "--system-tokens", "96", "--user-tokens", "40", "--reply-tokens", "16",
                              "--max-tokens", "4", "--layers", "2", "--hidden", "128", "--heads", "4",
                              "--kv-heads", "2", "--max-model-len", "1024", "--kv-cache-mib", "32",
                              "--timeout-s", "600", "--workdir", workdir])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if not HAVE_VLLM:
        if os.environ.get("CI"):
            raise RuntimeError("vLLM is not installed: scripts/setup.sh installs it")
        pytest.skip("vLLM is not installed (scripts/setup.sh installs it)")
    from hicache.bench.vllm_bench import measure

    args = _tiny_args(str(tmp_path_factory.mktemp("bench-vllm")))
    return args, measure(args)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hicache_computes_only_the_new_tokens_of_warm_turns(measured):
    from hicache.bench.vllm_bench import kv_bytes_per_token, rows

    args, m = measured
    assert list(m) == ["none", "hicache"]
    # turn 2 prompts: 96 + 40 + 16 + 40 = 192 tokens = 6 blocks of 32. After the reset vLLM alone
    # has only what the turn computes: the second conversation finds the first's 3 system-prompt
    # blocks. hicache holds turn 1's full blocks (136 tokens -> 4 blocks = 128 tokens).
    warm = {n: sum(r["prompt_tokens"] - r["cached"] for r in x.requests if r["turn"] == 1) for n, x in m.items()}
    assert warm["none"] == 2 * 192 - 96
    assert warm["hicache"] == 2 * (192 - 128)
    # vLLM counts an external hit only past its local one: the second conversation may find the
    # system prompt (3 blocks) that the first one's load put into vLLM's cache, and load 1 block
    assert m["hicache"].transfers["loaded_tokens"] in (128 + (128 - 96), 2 * 128)
    assert m["hicache"].transfers["saved_tokens"] > 0 and m["hicache"].transfers["load_s"] > 0
    table = {r["name"]: r for r in rows(m, kv_bytes_per_token(args), poisson=False)}
    r = table["prefill tokens computed, warm (turns 2+) [hicache]"]
    assert (r["value"], r["baseline"], r["baseline_name"]) == (warm["hicache"], warm["none"], "vLLM alone")
    assert r["ratio"] == pytest.approx(warm["hicache"] / warm["none"])
    assert table["load GB/s [hicache]"]["value"] > 0 and "load GB/s [none]" not in table
    for name in ("ttft mean, warm (turns 2+) [hicache]", "ttft p90, cold (turn 1) [none]",
                 "generate wall, all turns [hicache]"):
        assert table[name]["value"] > 0
    # the connector's calls took time in both turns' steps (turn 1 saved, turn 2 loaded), less than the turns
    steps = m["hicache"].step_s
    walls = (m["hicache"].wall_s - m["hicache"].warm_wall_s, m["hicache"].warm_wall_s)
    assert len(steps) == 2 and all(0 < s < w for s, w in zip(steps, walls))
    cold = table["connector time in steps, cold (turn 1) [hicache]"]
    assert cold["value"] == pytest.approx(steps[0] * 1e3)
    assert "connector time in steps, cold (turn 1) [none]" not in table
    share = table["connector time in steps / cold TTFT of vLLM alone [hicache]"]["value"]
    assert share == pytest.approx(steps[0] * 1e3 / table["ttft mean, cold (turn 1) [none]"]["value"])
    # the parts of each TTFT from vLLM's engine timestamps: both there, and within the TTFT
    for x in m.values():
        for r in x.requests:
            assert r["queued"] >= 0 and r["prefill"] > 0
            assert r["queued"] + r["prefill"] <= r["ttft"] + 1e-3  # engine clock vs the frontend's
    part = table["ttft part mean, scheduled to first token, warm (turns 2+) [hicache]"]
    assert 0 < part["value"] <= table["ttft mean, warm (turns 2+) [hicache]"]["value"]


def test_the_ttft_parts_come_from_the_engine_core_timestamps():
    from types import SimpleNamespace

    from hicache.integrations.vllm_driver import _engine_parts

    out = SimpleNamespace(metrics=SimpleNamespace(queued_ts=10.0, scheduled_ts=10.25, first_token_ts=11.0))
    assert _engine_parts(out) == (0.25, 0.75)
    # vLLM without stats (disable_log_stats) leaves them 0: no parts rather than wrong ones
    assert _engine_parts(SimpleNamespace(metrics=SimpleNamespace(queued_ts=0.0, scheduled_ts=0.0,
                                                                 first_token_ts=0.0))) == (None, None)
    assert _engine_parts(SimpleNamespace(metrics=None)) == (None, None)


def test_rows_split_the_ttft_into_the_engines_queue_and_the_prefill():
    from hicache.bench.vllm_bench import Measured, rows

    def run(name: str, queued: list[float]) -> Measured:
        reqs = [{"conversation": c, "turn": t, "outputs": [1], "cached": 0, "ttft": 0.5, "queued": q,
                 "prefill": 0.3, "prompt_tokens": 64} for t in (0, 1) for c, q in enumerate(queued)]
        return Measured(name, reqs, 2.0, 1.0, 1.0)

    table = {r["name"]: r for r in rows({"none": run("none", [0.0, 0.2]), "lmcache": run("lmcache", [0.1, 0.1])},
                                        16384, poisson=False)}
    assert table["ttft part mean, queued in the engine, warm (turns 2+) [none]"]["value"] == pytest.approx(100.0)
    q = table["ttft part mean, queued in the engine, cold (turn 1) [lmcache]"]
    assert (q["value"], q["ratio"]) == (pytest.approx(100.0), pytest.approx(1.0))
    assert table["ttft part mean, scheduled to first token, warm (turns 2+) [lmcache]"]["value"] == pytest.approx(300.0)
    # a run whose vLLM kept no timestamps: its cells say so, the others stay
    blind = run("hicache", [0.0, 0.0])
    for r in blind.requests:
        r["queued"] = r["prefill"] = None
    table = {r["name"]: r for r in rows({"none": run("none", [0.0, 0.2]), "hicache": blind}, 16384, poisson=False)}
    assert math.isnan(table["ttft part mean, queued in the engine, warm (turns 2+) [hicache]"]["value"])
    assert table["ttft part mean, queued in the engine, warm (turns 2+) [none]"]["value"] == pytest.approx(100.0)


def test_rows_of_a_peer_without_step_times_say_not_exposed():
    from hicache.bench.vllm_bench import Measured, rows

    def run(name: str, ttft: float, step_s: list[float] | None) -> Measured:
        reqs = [{"conversation": 0, "turn": t, "outputs": [1], "cached": 0, "ttft": ttft, "prompt_tokens": 64}
                for t in (0, 1)]
        return Measured(name, reqs, 2.0, 1.0, 1.0, {}, step_s)

    measured = {"none": run("none", 0.5, None), "hicache": run("hicache", 0.5, [0.01, 0.02]),
                "lmcache": run("lmcache", 0.5, None)}
    measured["hicache"].transfers.update(saved_tokens=1000, save_s=0.004, loaded_tokens=500, load_s=0.001,
                                         save_cpu_s=0.001, load_cpu_s=0.0)
    table = {r["name"]: r for r in rows(measured, 16384, poisson=False, memcpy=8.192)}
    assert table["connector time in steps, cold (turn 1) [hicache]"]["value"] == pytest.approx(10.0)
    # the copies against a memcpy of the same machine: 16384 bytes per token
    assert table["save GB/s vs memcpy [hicache]"]["ratio"] == pytest.approx(1000 * 16384 / 0.004 / 1e9 / 8.192)
    assert table["load GB/s vs memcpy [hicache]"]["ratio"] == pytest.approx(1.0)
    assert "save GB/s vs memcpy [lmcache]" not in table  # it said nothing of what it moved
    # over the copy thread's CPU time: the copy's own speed (4x the wall rate: it waited 3/4)
    cpu = table["save GB/s, copy thread's CPU time vs memcpy [hicache]"]
    assert cpu["ratio"] == pytest.approx(4 * table["save GB/s vs memcpy [hicache]"]["ratio"])
    assert "load GB/s, copy thread's CPU time vs memcpy [hicache]" not in table  # no CPU time reported
    assert not any("CPU time" in name for name in table if "[lmcache]" in name)
    assert table["connector time in steps, warm (turns 2+) [hicache]"]["value"] == pytest.approx(20.0)
    assert math.isnan(table["connector time in steps, cold (turn 1) [lmcache]"]["value"])
    assert table["connector time in steps / cold TTFT of vLLM alone [hicache]"]["value"] == pytest.approx(0.02)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_outputs_that_differ_are_refused(measured):
    from hicache.bench.vllm_bench import OutputsDiffer, check_outputs_equal

    _, m = measured
    check_outputs_equal(m)  # the real run: equal
    garbled = copy.deepcopy(m)
    garbled["hicache"].requests[-1]["outputs"][0] += 1
    with pytest.raises(OutputsDiffer, match=r"outputs of hicache differ .* in 1 of 4 requests"):
        check_outputs_equal(garbled)
    missing = copy.deepcopy(m)
    del missing["hicache"].requests[0]
    with pytest.raises(OutputsDiffer, match="conversation 0, turn 0"):
        check_outputs_equal(missing)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chart_of_a_run_is_drawn_from_its_json(measured, tmp_path):
    """`hicache bench vllm --json` output of the real run, then `hicache bench plot` draws it."""
    if not os.environ.get("CI"):  # scripts/setup.sh installs the plot extra
        pytest.importorskip("matplotlib")
    from PIL import Image

    from hicache.bench.report import print_rows
    from hicache.bench.vllm_bench import kv_bytes_per_token, rows

    args, m = measured
    results = tmp_path / "vllm.json"
    with open(results, "w") as f:
        print_rows("vllm", rows(m, kv_bytes_per_token(args), poisson=False), True, {"date": "today"}, out=f)
    chart = tmp_path / "vllm.png"
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "plot", str(results), str(chart)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with Image.open(chart) as im:
        assert im.format == "PNG" and im.size[0] > 300
