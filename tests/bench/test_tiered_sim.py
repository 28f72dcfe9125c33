"""Host + disk placement and admission simulated: scenarios with known answers."""

from __future__ import annotations

from hicache.bench.policy.policy_sim import BlockTrace, block_trace
from hicache.bench.policy.tiered_sim import VARIANTS, TieredSim, simulate_tiered, simulate_variants
from hicache.bench.traces.workloads import generate
from hicache.index.admission import AdmissionConfig


def trace(*requests: tuple[int, ...]) -> BlockTrace:
    return BlockTrace(tuple(requests), 512 * sum(len(r) for r in requests), 512)


def test_inclusive_holds_about_the_disk_exclusive_holds_host_plus_disk():
    # blocks 1..4 one request each, then all four again: 4 distinct blocks, host 2 + disk 2
    t = trace((1,), (2,), (3,), (4,), (1,), (2,), (3,), (4,))
    inclusive = simulate_tiered(t, TieredSim(2, 2, "inclusive"))
    exclusive = simulate_tiered(t, TieredSim(2, 2, "exclusive"))
    assert exclusive.hit_rate == 0.5  # every second round is a hit: 4 blocks fit in 2 + 2
    assert inclusive.hit_rate < exclusive.hit_rate  # the disk mirrors the host: 2 distinct blocks
    assert exclusive.disk_hits == 4 and exclusive.disk_writes >= 4


def test_non_inclusive_does_not_rewrite_a_block_that_kept_its_disk_copy():
    t = trace((1,), (2,), (1,), (3,), (1,), (4,), (1,))
    non = simulate_tiered(t, TieredSim(1, 3, "non-inclusive"))
    exc = simulate_tiered(t, TieredSim(1, 3, "exclusive"))
    assert non.hit_rate == exc.hit_rate
    assert non.disk_writes < exc.disk_writes  # block 1 goes down once, not on every trip


def test_admission_cuts_the_writes_of_one_shot_scans():
    t = block_trace(generate("scan", 1500, seed=1), 512)
    cap = t.unique_blocks() // 7
    every = simulate_tiered(t, TieredSim(cap // 3, cap - cap // 3, "non-inclusive", AdmissionConfig(mode="all")))
    reuse = simulate_tiered(t, TieredSim(cap // 3, cap - cap // 3, "non-inclusive", AdmissionConfig()))
    assert reuse.disk_writes < 0.8 * every.disk_writes
    assert reuse.hit_rate >= every.hit_rate


def test_every_variant_runs_and_is_deterministic():
    t = block_trace(generate("mixed", 600, seed=2), 512)
    first = simulate_variants(t, 100, 200)
    assert list(first) == list(VARIANTS)
    assert first == simulate_variants(t, 100, 200)
