"""The simulated policies on sequences small enough to check by hand, and their bounds on random ones."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.bench.policy.policy_sim import (
    ONLINE,
    BlockTrace,
    InfinitePolicy,
    LruPolicy,
    OptPolicy,
    block_trace,
    make_policy,
    simulate,
    simulate_all,
)

ALL = ("infinite", "OPT", *ONLINE)


def trace_of(*requests: tuple[int, ...], block_tokens: int = 1) -> BlockTrace:
    return BlockTrace(tuple(requests), sum(len(r) for r in requests) * block_tokens, block_tokens)


def random_tree_trace(seed: int, num_requests: int = 300) -> tuple[BlockTrace, dict[int, int | None]]:
    """Conversations under a few shared system prompts: each request extends an earlier
    one of its conversation (or starts one), so ids form a prefix tree. Returns the
    trace and each block's parent."""
    rng = np.random.default_rng(seed)
    parent: dict[int, int | None] = {}
    next_id = 0

    def grow(prefix: tuple[int, ...], n: int) -> tuple[int, ...]:
        nonlocal next_id
        out = list(prefix)
        for _ in range(n):
            parent[next_id] = out[-1] if out else None
            out.append(next_id)
            next_id += 1
        return tuple(out)

    systems = [grow((), int(rng.integers(1, 4))) for _ in range(3)]
    convs: list[tuple[int, ...]] = []
    reqs = []
    for _ in range(num_requests):
        if not convs or rng.random() < 0.25:
            convs.append(grow(systems[int(rng.integers(len(systems)))], int(rng.integers(1, 4))))
            c = len(convs) - 1
        else:
            c = int(rng.integers(len(convs)))
            if rng.random() < 0.7:
                convs[c] = grow(convs[c], int(rng.integers(1, 3)))
        reqs.append(convs[c])
    return trace_of(*reqs), parent


def test_cyclic_scan_lru_hits_nothing_opt_keeps_what_comes_back_soonest():
    # capacity 2, blocks 1 2 3 1 2 3 (each its own one-block request)
    t = trace_of((1,), (2,), (3,), (1,), (2,), (3,))
    assert simulate(t, LruPolicy(2)).hit_blocks == 0
    # OPT: keeps 1 and 2, bypasses 3 (needed after both): 1 and 2 hit, 3 misses
    assert simulate(t, OptPolicy(2, t)).hit_blocks == 2
    assert simulate(t, InfinitePolicy()).hit_blocks == 3


def test_hit_is_the_leading_run_of_cached_blocks():
    # store 1,2,3 - scan 4 (LRU evicts the leaf 3, not the root 1) - ask 1,2,3: two blocks hit
    t = trace_of((1, 2, 3), (4,), (1, 2, 3))
    lru = LruPolicy(3)
    r = simulate(t, lru)
    assert r.hit_blocks == 2 and r.total_blocks == 7
    assert lru.cached() == {1, 2, 3}  # re-admitting 1,2,3 pushed out 4


def test_lru_evicts_descendants_before_ancestors():
    lru = LruPolicy(3)
    lru.request((1, 2, 3), 0)
    lru.request((4,), 3)
    assert lru.cached() == {1, 2, 4}
    lru.request((5,), 4)
    assert lru.cached() == {1, 4, 5}


def test_opt_equals_infinite_when_everything_fits():
    t, _ = random_tree_trace(1)
    unique = t.unique_blocks()
    inf = simulate(t, InfinitePolicy()).hit_blocks
    assert simulate(t, OptPolicy(unique, t)).hit_blocks == inf
    assert simulate(t, LruPolicy(unique)).hit_blocks == inf


@pytest.mark.parametrize("seed", range(4))
def test_opt_is_never_below_any_online_policy_nor_above_infinite(seed):
    t, _ = random_tree_trace(seed)
    unique = t.unique_blocks()
    for cap in (1, 3, unique // 10, unique // 4, unique // 2):
        res = simulate_all(t, cap, ALL)
        opt = res["OPT"].hit_blocks
        assert opt <= res["infinite"].hit_blocks
        for name in ONLINE:
            assert res[name].hit_blocks <= opt, (name, cap)


@pytest.mark.parametrize("name", ["OPT", "LRU"])
def test_cached_set_stays_prefix_closed(name):
    """Descendants before ancestors: no cached block ever outlives its parent."""
    t, parent = random_tree_trace(7)
    pol = make_policy(name, t.unique_blocks() // 8, t)
    pos = 0
    for ids in t.requests:
        pol.request(ids, pos)
        pos += len(ids)
        cached = pol.cached()
        orphans = [b for b in cached if parent[b] is not None and parent[b] not in cached]
        assert not orphans
        assert len(cached) <= pol.capacity


@pytest.mark.parametrize("name", ONLINE)
def test_online_policies_respect_capacity_and_replay_identically(name):
    t, _ = random_tree_trace(3)
    cap = t.unique_blocks() // 6
    first = simulate(t, make_policy(name, cap, t))
    pol = make_policy(name, cap, t)
    again = simulate(t, pol)
    assert first == again
    assert len(pol.cached()) <= cap
    assert 0 < first.hit_blocks <= simulate(t, OptPolicy(cap, t)).hit_blocks


def test_block_trace_drops_the_partial_block_but_counts_its_tokens():
    t = block_trace([{"input_length": 1030, "hash_ids": [5, 6, 7]}], 512)
    assert t.requests == ((5, 6),) and t.prompt_tokens == 1030


def test_frecency_sim_is_deterministic_and_resists_scans():
    """hicache's policy, simulated: same hits on a replay, and on the scan workload (one-shot
    documents between conversations) it keeps more of the hot set than LRU."""
    from hicache.bench.traces.workloads import generate

    t = block_trace(generate("scan", 1500, seed=3), 512)
    cap = t.unique_blocks() // 10
    a, b = simulate(t, make_policy("frecency", cap, t)), simulate(t, make_policy("frecency", cap, t))
    assert a.hit_blocks == b.hit_blocks
    lru = simulate(t, make_policy("LRU", cap, t))
    opt = simulate(t, make_policy("OPT", cap, t))
    assert lru.hit_blocks < a.hit_blocks <= opt.hit_blocks
