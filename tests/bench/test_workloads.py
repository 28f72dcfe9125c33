"""Generated workloads: deterministic, prefix-consistent, and shaped as their names say."""

from __future__ import annotations

import pytest

from hicache.bench.policy.policy_sim import block_trace, simulate_all
from hicache.bench.traces.workloads import BLOCK, WORKLOADS, generate


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_trace_and_every_id_has_one_parent(name):
    reqs = generate(name, 300, seed=3)
    assert reqs == generate(name, 300, seed=3)
    assert reqs != generate(name, 300, seed=4)
    parent: dict[int, int] = {}
    for r in reqs:
        ids = r["hash_ids"]
        assert len(ids) == r["input_length"] // BLOCK + 1  # full blocks + the partial tail
        for i, b in enumerate(ids):
            assert parent.setdefault(b, ids[i - 1] if i else -1) == (ids[i - 1] if i else -1)


def test_agents_share_their_long_system_prompts():
    t = block_trace(generate("agent", 400), BLOCK)
    firsts = {r[0] for r in t.requests}
    assert len(firsts) <= 32 and min(len(r) for r in t.requests) >= 25


def test_scan_hurts_lru_more_than_scan_resistant_policies():
    t = block_trace(generate("scan", 3000), BLOCK)
    res = simulate_all(t, t.unique_blocks() // 10, ("OPT", "LRU", "S3-FIFO"))
    assert res["LRU"].hit_blocks < res["S3-FIFO"].hit_blocks <= res["OPT"].hit_blocks
