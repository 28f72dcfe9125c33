"""Structure signals as eviction priorities: a prefix cache still, bounded by OPT, and not a no-op."""

from __future__ import annotations

import pytest

from hicache.bench.policy.policy_sim import LruPolicy, OptPolicy, simulate
from hicache.bench.policy.signal_sim import BASES, SIGNALS, SignalSim, signal_rows
from tests.bench.test_policy_sim import random_tree_trace

VARIANTS = [(b, s) for b in BASES for s in SIGNALS]


def test_lru_without_a_signal_is_policy_sims_lru():
    for seed in range(3):
        trace, _ = random_tree_trace(seed)
        for cap in (5, 20, 60):
            assert simulate(trace, SignalSim(cap, "LRU")).hit_blocks == simulate(trace, LruPolicy(cap)).hit_blocks


@pytest.mark.parametrize(("base", "signal"), VARIANTS)
def test_a_parent_never_leaves_before_its_child(base, signal):
    """Each block's priority is raised to its child's: whatever the signal, every cached
    block's parent is cached (a prefix cache can use nothing below a hole)."""
    trace, parent = random_tree_trace(7)
    sim = SignalSim(12, base, signal, window=4)
    for pos, ids in enumerate(trace.requests):
        sim.request(ids, pos)
        held = sim.cached()
        assert len(held) <= 12
        assert all(parent[b] is None or parent[b] in held for b in held)


@pytest.mark.parametrize(("base", "signal"), VARIANTS)
def test_every_variant_is_below_opt_and_reaches_it_with_room_for_all(base, signal):
    trace, _ = random_tree_trace(3)
    for cap in (8, 30):
        ours = simulate(trace, SignalSim(cap, base, signal)).hit_blocks
        assert 0 < ours <= simulate(trace, OptPolicy(cap, trace)).hit_blocks
    everything = trace.unique_blocks()
    assert simulate(trace, SignalSim(everything, base, signal)).hit_blocks == simulate(
        trace, OptPolicy(everything, trace)).hit_blocks


def test_signals_change_what_is_kept():
    trace, _ = random_tree_trace(1, num_requests=600)
    lru = simulate(trace, SignalSim(20, "LRU")).hit_blocks
    assert {simulate(trace, SignalSim(20, "LRU", s)).hit_blocks for s in SIGNALS[1:]} - {lru}


def test_rows_are_computed_from_the_run():
    trace, _ = random_tree_trace(2)
    lru = simulate(trace, LruPolicy(15)).hit_rate
    opt = simulate(trace, OptPolicy(15, trace)).hit_rate
    rows = {r["name"]: r for r in signal_rows(trace, "t", 15, opt, lru)}
    assert rows["signals @ t: LRU: hit rate"]["value"] == lru
    fan = rows["signals @ t: frecency + fan-out: hit rate"]
    assert fan["baseline"] == lru and fan["opt"] == opt
    alone = rows["signals @ t: frecency: hit rate"]["value"]
    assert fan["change_over_base"] == pytest.approx(fan["value"] - alone)
    assert fan["value"] == simulate(trace, SignalSim(15, "frecency", "fan-out")).hit_rate


def test_bad_base_or_signal_is_refused():
    with pytest.raises(ValueError, match="base"):
        SignalSim(4, "ARC")
    with pytest.raises(ValueError, match="signal"):
        SignalSim(4, "LRU", "tail")
