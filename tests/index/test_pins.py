"""Pinned prefixes over a real RadixIndex (hicache/index/pins.py), as scripts."""

from __future__ import annotations

import pytest

from hicache.index.pins import PinBoundError, PinError, PinNotStored, PinTable
from hicache.index.radix import Tier
from radix_util import SALT, check_invariants, ids, make_index, seq

HOST, DISK = Tier.HOST, Tier.DISK
FAR = 1e12  # an expiry nobody reaches


def host_keys(idx) -> set[bytes]:
    return {k for n in idx.iter_nodes() if n.host is not None for k in n.keys}


def test_a_pinned_prefix_outlives_eviction_and_goes_once_unpinned():
    idx, pins = make_index(), PinTable()
    ka, ta = seq(1, 2, 3)
    kb, tb = seq(1, 2, 7, 8)  # shares two pages with a
    kc, tc = seq(9, 9)
    idx.insert(ka, ta, host_pages=ids(1, 2, 3))
    idx.insert(kb, tb, host_pages=ids(1, 2, 4, 5))
    idx.insert(kc, tc, host_pages=ids(6, 7))
    pin = pins.pin(idx, SALT, HOST, ka, FAR, 0, max_pages=8)
    assert pin.pinned == ka and pins.pinned_pages(SALT, HOST) == 3
    idx.evict(HOST, 100)
    assert host_keys(idx) == set(ka)  # b's own pages and c went; a's path stayed
    check_invariants(idx, [(pin.node, HOST, None)])
    assert len(pins.unpin(SALT, ka)) == 1 and pins.pinned_pages(SALT, HOST) == 0
    idx.evict(HOST, 100)
    assert host_keys(idx) == set()
    check_invariants(idx)


def test_the_bound_counts_shared_pages_once_and_a_refused_pin_changes_nothing():
    idx, pins = make_index(), PinTable()
    ka, ta = seq(1, 2, 3)
    kb, tb = seq(1, 2, 7)
    kc, tc = seq(5, 6)
    for k, t, s in ((ka, ta, ids(1, 2, 3)), (kb, tb, ids(1, 2, 4)), (kc, tc, ids(5, 6))):
        idx.insert(k, t, host_pages=s)
    pins.pin(idx, SALT, HOST, ka, FAR, 0, max_pages=4)
    pins.pin(idx, SALT, HOST, kb, FAR, 0, max_pages=4)  # 1 new page: 4 in all
    assert pins.pinned_pages(SALT, HOST) == 4
    with pytest.raises(PinBoundError, match="bound of 4"):
        pins.pin(idx, SALT, HOST, kc, FAR, 0, max_pages=4)
    assert pins.pinned_pages(SALT, HOST) == 4 and len(pins.pins) == 2 and pins.counters["refused"] == 1
    idx.evict(HOST, 100)
    assert host_keys(idx) == set(ka) | set(kb)  # c was not locked by the refused pin
    # the same prefix again: refreshed, not counted twice
    again = pins.pin(idx, SALT, HOST, ka, FAR + 1, 3, max_pages=4)
    assert again.priority == 3 and len(pins.pins) == 2 and pins.pinned_pages(SALT, HOST) == 4
    check_invariants(idx, [(p.node, HOST, None) for p in pins.pins.values()])


def test_only_stored_pages_are_pinned_and_a_prefix_with_none_is_refused():
    idx, pins = make_index(), PinTable()
    ka, ta = seq(1, 2, 3, 4)
    idx.insert(ka[:2], ta[:8], host_pages=ids(1, 2))
    idx.insert(ka, ta, engine=0, device_pages=ids(7, 8, 9, 10))  # pages 3, 4 only on a device
    pin = pins.pin(idx, SALT, HOST, ka, FAR, 0, max_pages=8)
    assert pin.pinned == ka[:2]
    kz, _ = seq(42)
    with pytest.raises(PinNotStored):
        pins.pin(idx, SALT, HOST, kz, FAR, 0, max_pages=8)
    with pytest.raises(PinError):
        pins.pin(idx, SALT, Tier.DEVICE, ka, FAR, 0, max_pages=8)


def test_a_disk_pin_keeps_pages_on_disk_and_pins_expire():
    idx, pins = make_index(), PinTable()
    ka, ta = seq(1, 2)
    kb, tb = seq(3, 4)
    idx.insert(ka, ta, on_disk=True)
    idx.insert(kb, tb, on_disk=True)
    pins.pin(idx, SALT, DISK, ka, 100.0, 0, max_pages=8)
    idx.evict(DISK, 100)
    assert {k for n in idx.iter_nodes() if n.on_disk for k in n.keys} == set(ka)
    assert pins.expire(99.0) == [] and len(pins.expire(100.0)) == 1 and pins.counters["expired"] == 1
    idx.evict(DISK, 100)
    assert not list(idx.iter_nodes())
    check_invariants(idx)


def test_over_quota_pins_give_way_lowest_priority_first_and_come_back_highest_first():
    idx = make_index()
    over = {"yes": False}
    pins = PinTable(within_quota=lambda salt, tier: not over["yes"])
    seqs = [seq(10 * i + 1, 10 * i + 2) for i in range(3)]
    for i, (k, t) in enumerate(seqs):
        idx.insert(k, t, host_pages=ids(2 * i + 1, 2 * i + 2))
    made = [pins.pin(idx, SALT, HOST, k, FAR, prio, max_pages=8) for (k, _), prio in zip(seqs, (5, 1, 9))]
    assert pins.enforce(lambda salt: idx) == []  # within quota: nothing changes
    over["yes"] = True
    assert pins.enforce(lambda salt: idx) == [made[1]]  # priority 1 first
    assert pins.enforce(lambda salt: idx) == [made[0]]
    assert [p.active for p in made] == [False, False, True]
    idx.evict(HOST, 100)
    assert host_keys(idx) == set(seqs[2][0])  # the suspended pins' pages could go
    over["yes"] = False
    for k, t in seqs[:2]:
        idx.insert(k, t, host_pages=ids(20, 21) if k is seqs[0][0] else ids(22, 23))
    pins.enforce(lambda salt: idx)
    assert [p.active for p in made] == [True, False, True]  # priority 5 back before 1
    pins.enforce(lambda salt: idx)
    assert all(p.active for p in made) and pins.counters["resumed"] == 2
    check_invariants(idx, [(p.node, HOST, None) for p in made])
