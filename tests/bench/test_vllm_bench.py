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
from pathlib import Path

import pytest

from hicache.bench.engines.vllm_peers import parse_compare
from hicache.bench.engines.vllm_workload import conversations, poisson_gaps

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
    code = ("import sys; sys.modules['lmcache'] = None; from hicache.cli.main import main; "
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
    from hicache.bench.engines.vllm_bench import measure

    args = _tiny_args(str(tmp_path_factory.mktemp("bench-vllm")))
    return args, measure(args)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hicache_computes_only_the_new_tokens_of_warm_turns(measured):
    from hicache.bench.engines.vllm_bench import kv_bytes_per_token, rows

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
    from hicache.bench.engines.vllm_bench import Measured, rows

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
    from hicache.bench.engines.vllm_bench import Measured, rows

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
    from hicache.bench.engines.vllm_bench import check_outputs_equal
    from hicache.bench.engines.vllm_peers import OutputsDiffer

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

    from hicache.bench.engines.vllm_bench import kv_bytes_per_token, rows
    from hicache.bench.report import print_rows

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


# -- the concurrent mode (`--concurrency N`): hicache/bench/engines/vllm_steps.py ---------------------------


def test_concurrent_prompts_share_a_few_prefixes_and_differ_after_them():
    from hicache.bench.engines.vllm_workload import shared_prefix_prompts

    prompts = shared_prefix_prompts(12, 4, prefix_tokens=40, min_tokens=50, max_tokens=90, seed=3)
    assert prompts == shared_prefix_prompts(12, 4, 40, 50, 90, seed=3)
    assert all(50 <= len(p) <= 90 for p in prompts)
    for i, p in enumerate(prompts):
        assert p[:40] == prompts[i % 4][:40]  # prefix i % 4
        assert p[:40] != prompts[(i + 1) % 4][:40]
    assert len({tuple(p[40:50]) for p in prompts}) == 12  # each suffix its own
    other = shared_prefix_prompts(12, 4, 40, 50, 90, seed=4)  # the next repeat: nothing shared
    assert not {tuple(p[:32]) for p in prompts} & {tuple(p[:32]) for p in other}
    for bad in ((0, 4, 40, 50, 90), (12, 4, 50, 50, 90), (12, 4, 40, 91, 90)):
        with pytest.raises(ValueError):
            shared_prefix_prompts(*bad)


def test_a_hicache_daemon_may_be_placed_and_a_bad_placement_is_refused():
    from hicache.bench.engines.vllm_peers import split_name
    from hicache.bench.engines.vllm_placement import DaemonPlacement

    assert parse_compare("hicache:cpus=1,lmcache") == ["none", "hicache:cpus=1", "lmcache"]
    base, placement = split_name("hicache-host:nice=-5:cpus=0-1:weight=500")
    assert base == "hicache-host" and placement == DaemonPlacement("0-1", -5, 500)
    assert placement.serve_flags() == ["--cpus", "0-1"]
    for bad in ("lmcache:cpus=1", "hicache:cpu=1", "hicache:nice=-30", "hicache:cpus=x", "hicache:nice=1:nice=2",
                "hicache:weight=0", "none:nice=1"):
        with pytest.raises(ValueError):
            parse_compare(bad)


def test_nice_reaches_every_thread_of_the_daemon_and_the_threads_it_starts_later(tmp_path):
    from hicache.bench.engines.vllm_placement import DaemonPlacement

    def nice_of(pid: int, tid: str) -> int:  # field 19 of stat, after the command's parentheses
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[16])

    go = tmp_path / "go"
    code = ("import os, threading, time, sys\n"
            "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
            "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(go)])
    try:
        from tests.wait import wait_until

        wait_until(lambda: len(os.listdir(f"/proc/{proc.pid}/task")) == 2, what="the first thread")
        assert DaemonPlacement(nice=7).apply(proc.pid, "hicache") is None
        go.touch()
        tids = wait_until(lambda: len(t := os.listdir(f"/proc/{proc.pid}/task")) == 3 and t,
                          what="the thread started after")
        assert [nice_of(proc.pid, t) for t in tids] == [7, 7, 7]
    finally:
        proc.kill()
        proc.wait()


def test_the_cpu_hogs_run_until_the_bench_ends():
    from hicache.bench.engines.vllm_placement import CpuHogs

    with CpuHogs(2) as hogs:
        assert len(hogs.procs) == 2 and all(p.poll() is None for p in hogs.procs)
        procs = list(hogs.procs)
    assert all(p.returncode is not None for p in procs) and not hogs.procs


def _phase_run(config: str, repeat: int, phase: str, wall_s: float, step_s: float, connector_s: float,
               cached: int = 0, outputs: list[int] | None = None):
    from hicache.bench.engines.vllm_steps_report import PhaseRun

    reqs = [{"outputs": outputs or [1, 2], "cached": cached, "prompt_tokens": 100, "ttft": 0.1 * (i + 1)}
            for i in range(4)]
    steps = [[step_s, connector_s, 400, 4, step_s / 2], [step_s / 2, connector_s, 4, 4, step_s / 4],
             [0.001, connector_s, 0, 0, 0.001]]
    calls = {"scheduler.get_num_new_matched_tokens": [connector_s] * 3, "worker.save_kv_layer": [connector_s / 1000]}
    if config == "none":
        steps = [[s[0], 0.0, *s[2:]] for s in steps]
        calls = {}
    return PhaseRun(config, repeat, phase, reqs, wall_s, steps, calls)


def test_rows_of_the_concurrent_mode_are_medians_over_repeats_against_vllm_alone():
    from hicache.bench.engines.vllm_steps_report import rows, summary_table

    runs = []
    for repeat, (alone, cached) in enumerate(((1.0, 64), (2.0, 64), (4.0, 96))):
        runs += [_phase_run("none", repeat, "no reuse", alone, 0.02, 0.0),
                 _phase_run("hicache", repeat, "no reuse", 2.0, 0.04, 0.002),
                 _phase_run("none", repeat, "reuse", alone, 0.02, 0.0),
                 _phase_run("hicache", repeat, "reuse", 1.0, 0.01, 0.001, cached=cached)]
    counters = {"none": {}, "hicache": {"engines gone (daemon log)": 0.0, "connector outages (engine log)": 1.0,
                                        "puts expired (stats)": 0.0}}
    table = {r["name"]: r for r in rows(runs, counters, {"cpu hogs": 2.0})}
    tok = table["no reuse: output tok/s [hicache]"]  # 8 tokens in 2 s; vLLM alone: 8, 4, 2 tok/s
    assert (tok["value"], tok["baseline"], tok["ratio"]) == (4.0, 4.0, 1.0)
    assert tok["note"] == "runs 0.50-2.00"
    assert table["reuse: prefill computed [hicache]"]["value"] == 4 * (100 - 64)
    assert table["reuse: prefill computed [none]"]["value"] == 400
    assert table["no reuse: step p50 [hicache]"]["value"] == pytest.approx(20.0)  # the steps that ran the model
    assert table["no reuse: decode step p50 [hicache]"]["value"] == pytest.approx(20.0)
    assert table["no reuse: step CPU p50 [hicache]"]["value"] == pytest.approx(10.0)
    assert table["no reuse: steps that scheduled nothing [hicache]"]["value"] == 1
    assert table["no reuse: connector ms per step, p50 [hicache]"]["value"] == pytest.approx(2.0)
    assert "no reuse: connector ms per step, p50 [none]" not in table  # vLLM alone has no connector
    assert table["no reuse: ttft mean [none]"]["value"] == pytest.approx(250.0)
    call = table["no reuse: connector call scheduler.get_num_new_matched_tokens [hicache]"]
    assert call["value"] == pytest.approx(2.0) and "3 calls" in call["note"]
    # a method under 1% of the connector's time shares a row with the others like it
    minor = table["no reuse: connector calls, 1 other methods [hicache]"]
    assert minor["value"] == pytest.approx(0.002) and "worker.save_kv_layer" in minor["note"]
    assert table["connector outages (engine log) [hicache]"]["value"] == 1.0
    md = summary_table(runs, counters)
    assert md.splitlines()[0] == "| median of 3 | vLLM alone | hicache |"
    assert "| no reuse: output tok/s (/ alone) | 4 | 4 (1.00, runs 0.50-2.00) |" in md
    assert "| engines gone / outages / puts expired | - | 0 / 1 / 0 |" in md


def test_concurrent_outputs_that_differ_are_refused():
    from hicache.bench.engines.vllm_peers import OutputsDiffer
    from hicache.bench.engines.vllm_steps import check_outputs

    runs = [_phase_run("none", 0, "reuse", 1.0, 0.02, 0.0), _phase_run("hicache", 0, "reuse", 1.0, 0.02, 0.0)]
    check_outputs(runs)
    runs.append(_phase_run("lmcache", 0, "reuse", 1.0, 0.02, 0.0, outputs=[1, 3]))
    with pytest.raises(OutputsDiffer, match=r"outputs of lmcache differ .* in 4 of 4 requests \(repeat 1, reuse"):
        check_outputs(runs)


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--concurrency", "8", "--prompt-tokens", "300-900"], "longer than --prefix-tokens"),
    (["--concurrency", "8", "--max-model-len", "1024"], "exceed --max-model-len"),
    (["--concurrency", "8", "--arrivals", "poisson"], "a mode of its own"),
])
def test_the_concurrent_mode_refuses_bad_options_before_starting_anything(tmp_path, flags, message):
    code = ("import sys; from hicache.cli.main import main; "
            "sys.exit(main(['bench', 'vllm', *sys.argv[2:], '--workdir', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w"), *flags], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert not (tmp_path / "w").exists()


def test_the_call_clock_times_each_interface_call_once():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from hicache.integrations.vllm_call_clock import CallClock, interface_methods

    class Connector(KVConnectorBase_V1):  # a connector's own methods on vLLM's interface
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.update_state_after_alloc(request, None, 0), False  # nested: inside the outer call

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return 32

        def helper(self):  # not an interface method: not timed
            return 1

        # the rest of the abstract interface, unused here
        def start_load_kv(self, forward_context, **kwargs): ...
        def wait_for_layer_load(self, layer_name): ...
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
        def wait_for_save(self): ...
        def build_connector_meta(self, scheduler_output): ...

    conn = object.__new__(Connector)  # vLLM builds connectors from its config; these methods need none
    names = interface_methods(conn)
    assert {"get_num_new_matched_tokens", "start_load_kv", "request_finished"} <= set(names)
    assert "helper" not in names and "build_kv_connector_stats" not in names  # a class method
    clock = CallClock()
    clock.install(conn, "scheduler")
    assert conn.get_num_new_matched_tokens(object(), 0) == (32, False)
    conn.update_state_after_alloc(object(), None, 0)
    assert conn.helper() == 1
    step_s = clock.take_step()
    calls = clock.take_calls()
    assert sorted(calls) == ["scheduler.get_num_new_matched_tokens", "scheduler.update_state_after_alloc"]
    assert [len(v) for v in calls.values()] == [1, 1]  # the nested call counted inside its caller only
    assert step_s == pytest.approx(sum(sum(v) for v in calls.values()))
    assert clock.take_step() == 0.0 and clock.take_calls() == {}


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory):
    if not HAVE_VLLM:
        if os.environ.get("CI"):
            raise RuntimeError("vLLM is not installed: scripts/setup.sh installs it")
        pytest.skip("vLLM is not installed (scripts/setup.sh installs it)")
    from hicache.bench.cli import add_parser
    from hicache.bench.engines.vllm_bench import resolve_defaults
    from hicache.bench.engines.vllm_steps import measure

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "vllm", "--concurrency", "8", "--repeats", "1", "--compare", "none,hicache",
                              "--timeout-s", "600", "--workdir", str(tmp_path_factory.mktemp("bench-vllm-steps"))])
    return measure(resolve_defaults(args))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_concurrent_mode_steps_real_engines_and_times_the_connector_inside_the_steps(concurrent):
    runs, counters, facts = concurrent
    by = {(r.config, r.phase): r for r in runs}
    assert sorted(by) == [("hicache", "no reuse"), ("hicache", "reuse"), ("none", "no reuse"), ("none", "reuse")]
    computed = {k: sum(q["prompt_tokens"] - q["cached"] for q in r.requests) for k, r in by.items()}
    # vLLM alone after the reset of its prefix cache: the same work again
    assert computed[("none", "reuse")] == computed[("none", "no reuse")]
    # hicache: at most each prompt's last partial block and the one token vLLM always computes
    assert computed[("hicache", "reuse")] <= sum(q["prompt_tokens"] % 32 or 32 for q in by[("none", "reuse")].requests)
    for (config, _), r in by.items():
        assert len(r.requests) == 8 and all(len(q["outputs"]) == 32 for q in r.requests)
        assert all(0 < q["ttft"] <= r.wall_s for q in r.requests)
        assert all(0 <= s[1] <= s[0] for s in r.steps)  # the connector's calls are inside the step
        assert all(0 < s[4] <= s[0] + 0.01 for s in r.steps if s[2])  # its thread's CPU within it (clock ticks)
        if config == "none":
            assert not r.calls and all(s[1] == 0 for s in r.steps)
        else:
            assert len(r.calls["scheduler.get_num_new_matched_tokens"]) >= 8  # every request asked
            assert len(r.calls["worker.start_load_kv"]) == len(r.steps)  # every step, the worker's side too
    assert by[("hicache", "reuse")].calls["worker.wait_for_layer_load"]
    assert counters["none"] == {} and counters["hicache"]["puts expired (stats)"] == 0
    assert set(counters["hicache"]) >= {"engines gone (daemon log)", "connector outages (engine log)"}
    assert facts["cpu hogs"] == 0
