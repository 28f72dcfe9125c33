"""Eviction policies on a real RadixIndex: frecency keeps reused pages longer than LRU does."""

from __future__ import annotations

import math

import pytest

from hicache.config import EVICTION_POLICIES
from hicache.index.node import Tier
from hicache.index.policy import POLICIES, FrecencyPolicy, LruPolicy, make_policy
from tests.index.radix_util import ids, make_index, seq

HOST = Tier.HOST


def test_policy_names_match_the_config_choices():
    assert set(POLICIES) == set(EVICTION_POLICIES)
    assert isinstance(make_policy("lru"), LruPolicy) and make_policy("frecency").name == "frecency"
    with pytest.raises(ValueError, match="frecency"):
        make_policy("mru")


def fill(idx, first: int, n: int) -> None:
    """n single-page sequences with distinct first pages, host slots first.."""
    for i in range(n):
        k, t = seq(first + i)
        idx.insert(k, t, host_pages=ids(first + i))


def test_frecency_learns_the_never_hit_lifetime_from_evictions():
    pol = FrecencyPolicy()
    idx = make_index(pol)
    fill(idx, 0, 4)  # ticks 1..4
    assert pol.bonus_unit == 0.0  # nothing evicted yet: plain LRU
    idx.evict(HOST, 1)  # tick 5 evicts page 0 (touched at tick 1): lifetime 4
    assert pol.lifetimes == {-1: 4.0} and pol.bonus_unit == 4.0
    idx.evict(HOST, 1)  # tick 6 evicts page 1 (tick 2): moving average toward 4 again
    assert pol.lifetimes[-1] == pytest.approx(4.0)


def slots(freed) -> list[int]:
    return sorted(int(p) for f in freed for p in f.slots)


@pytest.mark.parametrize("name,hot_kept", [("lru", False), ("frecency", True)])
def test_frecency_keeps_a_reused_page_that_lru_evicts(name, hot_kept):
    idx = make_index(make_policy(name))
    fill(idx, 0, 4)
    assert slots(idx.evict(HOST, 2)) == [0, 1]  # frecency learns a never-hit lifetime here
    hot, _ = seq(2)
    for _ in range(3):
        assert idx.match(hot).host_pages.tolist() == [2]  # page 2: three hits, then left alone
    fill(idx, 10, 3)  # newer never-hit pages 10, 11, 12
    freed = slots(idx.evict(HOST, 2))
    assert 3 in freed  # never hit and the oldest: first to go under either policy
    assert (2 not in freed) is hot_kept
    assert (idx.match(hot).host_pages.tolist() == [2]) is hot_kept


def test_frecency_priority_is_kept_until_the_next_touch():
    pol = FrecencyPolicy()
    idx = make_index(pol)
    fill(idx, 0, 3)
    idx.evict(HOST, 1)
    k, _ = seq(1)
    node = idx.match(k).nodes[0]
    first = pol.get_priority(node)
    assert first == pytest.approx(node.last_access + pol.bonus_unit * math.log2(2))
    pol.lifetimes[-1] *= 10  # the unit moves; the queued priority does not
    assert pol.get_priority(node) == first
    idx.match(k)  # a touch: recomputed, and higher
    assert pol.get_priority(node) > first


def test_frecency_evicts_children_before_their_parent():
    idx = make_index(FrecencyPolicy())
    fill(idx, 0, 2)
    idx.evict(HOST, 1)
    k, t = seq(5, 6, 7)
    idx.insert(k, t, host_pages=ids(5, 6, 7))
    for _ in range(3):
        idx.match(k[:1])  # the first page is hit, the pages below it are not
    fill(idx, 20, 1)
    # The hit page would outlive everything, but its subtree must go first.
    assert slots(idx.evict(HOST, 3)) == [1, 6, 7]
    assert slots(idx.evict(HOST, 2)) == [5, 20]
