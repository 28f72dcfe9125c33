"""Prefix priorities over a real RadixIndex (hicache/index/priorities.py), as scripts."""

from __future__ import annotations

import pytest

from hicache.index.pins import PinError, PinNotStored, PinTable
from hicache.index.policy import FrecencyPolicy
from hicache.index.priorities import PriorityBoundError, PriorityTable
from hicache.index.radix import Tier
from radix_util import SALT, check_invariants, ids, make_index, seq

HOST, DISK = Tier.HOST, Tier.DISK
FAR = 1e12


def host_keys(idx) -> set[bytes]:
    return {k for n in idx.iter_nodes() if n.host is not None for k in n.keys}


def store_three(idx):
    """a (oldest), b, c: plain LRU would evict them in that order."""
    out = []
    for i, k in enumerate((1, 3, 5)):
        keys, toks = seq(k, k + 1)
        idx.insert(keys, toks, host_pages=ids(2 * i, 2 * i + 1))
        out.append(keys)
    return out


@pytest.mark.parametrize("policy", [None, FrecencyPolicy()], ids=["lru", "frecency"])
def test_a_high_priority_prefix_leaves_last_and_falls_back_to_the_policy_when_it_goes(policy):
    idx, prio = make_index(policy), PriorityTable()
    a, b, c = store_three(idx)
    prio.set(idx, SALT, a, 5, FAR, max_pages=8)
    idx.evict(HOST, 2)
    assert host_keys(idx) == set(a) | set(c)  # b went, the oldest unprioritized
    assert prio.set(idx, SALT, a, 0, FAR, max_pages=8) is None  # 0 removes it: LRU again
    idx.evict(HOST, 2)
    assert host_keys(idx) == set(c)
    assert idx.hint_priority == {} and prio.stats()["prefixes"] == 0
    check_invariants(idx)


def test_a_negative_priority_sends_the_newest_prefix_first():
    idx, prio = make_index(), PriorityTable()
    a, b, c = store_three(idx)
    prio.set(idx, SALT, c, -3, FAR, max_pages=0)  # negative priorities are not bounded
    idx.evict(HOST, 2)
    assert host_keys(idx) == set(a) | set(b)


def test_an_expired_priority_stops_counting_and_the_heap_is_rekeyed():
    idx, prio = make_index(), PriorityTable()
    a, b, c = store_three(idx)
    prio.set(idx, SALT, a, 7, 100.0, max_pages=8)
    prio.set(idx, SALT, b, 3, 200.0, max_pages=8)
    assert idx.peek_evictable(HOST)[0] == 0  # c first
    assert prio.expire(150.0) == 1
    idx.evict(HOST, 2)
    assert host_keys(idx) == set(b) | set(c)  # a lost its priority: the oldest goes (c's key was 0 too, but newer)
    assert prio.counters["expired"] == 1


def test_shared_pages_take_the_highest_priority_and_keep_it_until_the_last_goes():
    idx, prio = make_index(), PriorityTable()
    ka, ta = seq(1, 2, 3)
    kb, tb = seq(1, 2, 7)
    kc, tc = seq(9, 9)
    for k, t, s in ((ka, ta, ids(1, 2, 3)), (kb, tb, ids(1, 2, 4)), (kc, tc, ids(5, 6))):
        idx.insert(k, t, host_pages=s)
    prio.set(idx, SALT, ka, 2, FAR, max_pages=8)
    prio.set(idx, SALT, kb, 9, FAR, max_pages=8)
    assert [idx.hint_priority[k] for k in ka] == [9, 9, 2]
    prio.set(idx, SALT, kb, 0, FAR, max_pages=8)
    assert [idx.hint_priority[k] for k in ka] == [2, 2, 2] and kb[2] not in idx.hint_priority
    assert prio.prioritized_pages(SALT) == 3


def test_the_bound_refuses_and_changes_nothing_and_unstored_prefixes_are_refused():
    idx, prio = make_index(), PriorityTable()
    a, b, c = store_three(idx)
    prio.set(idx, SALT, a, 4, FAR, max_pages=4)
    prio.set(idx, SALT, b, 4, FAR, max_pages=4)
    with pytest.raises(PriorityBoundError, match="bound of 4"):
        prio.set(idx, SALT, c, 1, FAR, max_pages=4)
    assert prio.prioritized_pages(SALT) == 4 and c[0] not in idx.hint_priority and prio.counters["refused"] == 1
    prio.set(idx, SALT, b, 6, FAR, max_pages=4)  # replacing one's priority is within the bound
    with pytest.raises(PinNotStored):
        prio.set(idx, SALT, seq(40, 41)[0], 1, FAR, max_pages=4)
    for bad in (1001, -1001, True, 1.5):
        with pytest.raises(PinError):
            prio.set(idx, SALT, a, bad, FAR, max_pages=4)
    assert [idx.hint_priority[k] for k in a + b] == [4, 4, 6, 6]


def test_a_pin_still_locks_what_a_lower_priority_elsewhere_would_not_save():
    idx, prio, pins = make_index(), PriorityTable(), PinTable()
    a, b, c = store_three(idx)
    pin = pins.pin(idx, SALT, HOST, a, FAR, 0, max_pages=8)
    prio.set(idx, SALT, b, 9, FAR, max_pages=8)
    idx.evict(HOST, 100)
    assert host_keys(idx) == set(a)  # the priority orders eviction; only the pin keeps pages against all of it
    check_invariants(idx, [(pin.node, HOST, None)])


def test_the_heaps_switch_to_full_keys_with_the_first_hint_and_back_after_the_last():
    idx, prio = make_index(), PriorityTable()
    a, b, c = store_three(idx)
    heaps = idx._ledger.candidates
    assert not heaps._keyed and idx.peek_evictable(HOST)[0] == 0  # peek speaks the full key either way
    prio.set(idx, SALT, a, -2, FAR, max_pages=8)
    assert heaps._keyed and idx.peek_evictable(HOST)[0] == -2
    prio.set(idx, SALT, a, 0, FAR, max_pages=8)
    assert not heaps._keyed and idx.peek_evictable(HOST)[0] == 0
    idx.evict(HOST, 2)
    assert host_keys(idx) == set(b) | set(c)
    check_invariants(idx)
