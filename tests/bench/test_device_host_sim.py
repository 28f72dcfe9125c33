"""Device-host placement simulated: hits and pages copied by hand, and exclusive as one LRU."""

from __future__ import annotations

import pytest

from hicache.bench.policy.device_host_sim import PLACEMENTS, DeviceHostSim, device_host_rows, simulate_device_host
from hicache.bench.policy.policy_sim import LruPolicy, OptPolicy, replay, simulate
from tests.bench.test_policy_sim import random_tree_trace, trace_of


@pytest.mark.parametrize(("placement", "hits", "down", "up"), [
    # one device page, one host page; blocks 1, 2, 1
    ("inclusive", 0, 3, 0),  # every page backed up as computed: 2's backup pushed 1 out of host
    ("exclusive", 1, 2, 1),  # 1 moves down for 2, up again for its hit; 2 moves down for it
    ("non-inclusive", 1, 2, 1),  # as exclusive, but 1's host copy stays until 2 pushes it out
])
def test_three_blocks_by_hand(placement, hits, down, up):
    sim = DeviceHostSim(1, 1, placement)
    r = simulate_device_host(trace_of((1,), (2,), (1,)), sim)
    assert (sim.host_hits, r.copied_down, r.copied_up) == (hits, down, up)
    assert r.hit_rate == pytest.approx(hits / 3)
    assert sim.cached() == ({1} if placement == "inclusive" else {1, 2})


def test_non_inclusive_rereads_without_rewriting():
    # device 1, host 2: 1, 2, 1, 2: each hit after the first pair is a copy up, and
    # neither block is written down a second time (its host copy stayed)
    sim = DeviceHostSim(1, 2, "non-inclusive")
    r = simulate_device_host(trace_of((1,), (2,), (1,), (2,)), sim)
    assert (sim.host_hits, r.copied_down, r.copied_up) == (2, 2, 2)
    ex = simulate_device_host(trace_of((1,), (2,), (1,), (2,)), DeviceHostSim(1, 2, "exclusive"))
    assert (ex.copied_down, ex.copied_up) == (3, 2)  # exclusive rewrites 1 on its second trip down


def test_exclusive_is_one_lru_of_both_capacities():
    """A page in exactly one pool, victims moving down to the host's most recent end:
    the pair orders blocks as one LRU of device + host does."""
    for seed in range(3):
        trace, _ = random_tree_trace(seed)
        for device, host in ((2, 6), (5, 20), (10, 0)):
            assert replay(trace, DeviceHostSim(device, host, "exclusive")) == replay(trace, LruPolicy(device + host))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_prefix_cache_below_opt(placement):
    trace, _ = random_tree_trace(4)
    r = simulate_device_host(trace, DeviceHostSim(4, 12, placement))
    assert 0 < r.host_hit_rate <= r.hit_rate <= simulate(trace, OptPolicy(16, trace)).hit_rate


def test_rows_are_computed_from_the_run():
    trace, _ = random_tree_trace(5)
    lru, opt = simulate(trace, LruPolicy(16)).hit_rate, simulate(trace, OptPolicy(16, trace)).hit_rate
    rows = {r["name"]: r for r in device_host_rows(trace, "t", 4, 12, opt, lru)}
    inc = simulate_device_host(trace, DeviceHostSim(4, 12, "inclusive"))
    assert rows["device-host @ t: inclusive: hit rate"]["value"] == inc.hit_rate
    copied = rows["device-host @ t: non-inclusive: pages copied"]
    assert copied["baseline"] == inc.copied and copied["device_to_host"] + copied["host_to_device"] == copied["value"]
    assert rows["device-host @ t: exclusive: hit rate"]["value"] == pytest.approx(lru)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="placement"):
        DeviceHostSim(1, 1, "mirrored")
    with pytest.raises(ValueError, match="device"):
        DeviceHostSim(0, 4)
