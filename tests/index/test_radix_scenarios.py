"""Scenario tests for RadixIndex: each reads as a short script."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.index.policy import LfuPolicy
from hicache.index.radix import IndexStateError, Tier
from radix_util import check_invariants, freed_by_tier, ids, make_index, seq

DEV, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def test_insert_two_sequences_then_match_shares_the_prefix():
    idx = make_index()
    ka, ta = seq(1, 2, 3, 4)
    kb, tb = seq(1, 2, 7, 8)
    r = idx.insert(ka, ta, engine=0, device_pages=ids(10, 11, 12, 13))
    assert r.present_pages == 0 and len(r.new_nodes) == 1
    r = idx.insert(kb, tb, engine=0, device_pages=ids(20, 21, 22, 23))
    assert r.present_pages == 2
    assert r.dup_device_pages.tolist() == [20, 21]      # pages 1,2 were already there
    assert [n.n_pages for n in r.nodes] == [2, 2]

    m = idx.match(kb, engine=0)
    assert (m.device_len, m.host_len, m.disk_len) == (4, 0, 0)
    assert m.device_pages.tolist() == [10, 11, 22, 23]
    assert m.last_node is r.nodes[-1]
    assert idx.match(ka, engine=1).num_pages == 0       # another engine has nothing
    (shared,) = idx.root.children.values()
    assert shared.n_pages == 2 and len(shared.children) == 2
    check_invariants(idx)


def test_match_splits_where_the_request_diverges_and_the_held_node_keeps_its_end():
    idx = make_index()
    ka, ta = seq(1, 2, 3, 4)
    leaf = idx.insert(ka, ta, engine=0, device_pages=ids(1, 2, 3, 4)).nodes[-1]
    kq, _ = seq(1, 2, 9)
    m = idx.match(kq, engine=0)
    assert m.device_pages.tolist() == [1, 2]
    assert m.last_node.n_pages == 2 and m.last_node is not leaf
    # The object the caller held is now the lower half: it still ends at page 4.
    assert leaf.n_pages == 2 and leaf.parent is m.last_node
    assert leaf.device[0].tolist() == [3, 4] and leaf.tokens.tolist() == ta[8:].tolist()
    check_invariants(idx)


def test_match_of_a_request_ending_inside_a_node_splits_there():
    idx = make_index()
    ka, ta = seq(1, 2, 3)
    idx.insert(ka, ta, host_pages=ids(5, 6, 7))
    m = idx.match(ka[:1])
    assert m.host_pages.tolist() == [5] and m.last_node.n_pages == 1
    assert idx.match(ka).host_pages.tolist() == [5, 6, 7]
    check_invariants(idx)


def test_match_updates_last_access_and_hit_count_of_matched_nodes_only():
    idx = make_index()
    ka, ta = seq(1, 2)
    kb, tb = seq(3, 4)
    na = idx.insert(ka, ta, host_pages=ids(0, 1)).nodes[-1]
    nb = idx.insert(kb, tb, host_pages=ids(2, 3)).nodes[-1]
    before = nb.last_access
    idx.match(ka)
    idx.match(ka)
    assert na.hit_count == 2 and na.last_access > before
    assert nb.hit_count == 0 and nb.last_access == before


def test_segments_device_then_host_then_disk():
    idx = make_index()
    k, t = seq(1, 2, 3, 4, 5)
    idx.insert(k, t, on_disk=True)
    idx.insert(k[:4], t[:16], host_pages=ids(40, 41, 42, 43))
    idx.insert(k[:2], t[:8], engine=3, device_pages=ids(7, 8))
    m = idx.match(k, engine=3)
    assert m.device_pages.tolist() == [7, 8]
    assert m.host_pages.tolist() == [42, 43]
    assert m.disk_keys == k[4:]
    assert [len(s) for s in (m.device_nodes, m.host_nodes, m.disk_nodes)] == [1, 1, 1]
    assert m.nodes == m.device_nodes + m.host_nodes + m.disk_nodes
    # Without an engine the device segment is empty; with another engine too.
    m = idx.match(k)
    assert (m.device_len, m.host_len, m.disk_len) == (0, 4, 1)
    assert idx.match(k, engine=9).host_pages.tolist() == [40, 41, 42, 43]
    check_invariants(idx)


def test_lock_refs_protect_from_eviction():
    idx = make_index()
    k, t = seq(1, 2, 3)
    idx.insert(k, t, engine=0, device_pages=ids(1, 2, 3))
    m = idx.match(k, engine=0)
    idx.lock(m.last_node, DEV, engine=0)
    assert idx.protected_pages(DEV, 0) == 3 and idx.evictable_pages(DEV, 0) == 0
    assert idx.evict(DEV, 10, engine=0) == []
    assert idx.peek_evictable(DEV, engine=0) is None
    check_invariants(idx, [(m.last_node, DEV, 0)])
    idx.unlock(m.last_node, DEV, engine=0)
    assert idx.evictable_pages(DEV, 0) == 3
    (f,) = idx.evict(DEV, 10, engine=0)
    assert (f.tier, f.engine, f.slots.tolist(), f.keys) == (DEV, 0, [1, 2, 3], k)
    assert list(idx.iter_nodes()) == []
    check_invariants(idx)


def test_device_lock_of_one_engine_does_not_pin_another_engines_copy():
    idx = make_index()
    k, t = seq(1, 2)
    idx.insert(k, t, engine=0, device_pages=ids(1, 2))
    node = idx.insert(k, t, engine=1, device_pages=ids(5, 6)).nodes[-1]
    idx.lock(node, DEV, engine=0)
    assert idx.evict(DEV, 2, engine=0) == []
    assert freed_by_tier(idx.evict(DEV, 2, engine=1)) == {(DEV, 1): (k, [5, 6])}
    idx.unlock(node, DEV, engine=0)
    # A lock without an engine protects every engine's copy.
    idx.insert(k, t, engine=1, device_pages=ids(7, 8))
    idx.lock(node, DEV)
    assert idx.evict(DEV, 2, engine=0) == [] and idx.evict(DEV, 2, engine=1) == []
    assert idx.protected_pages(DEV) == 4
    check_invariants(idx, [(node, DEV, None)])


def test_eviction_order_is_lru():
    idx = make_index()
    k1, t1 = seq(1, 1)
    k2, t2 = seq(2, 2)
    k3, t3 = seq(3, 3)
    idx.insert(k1, t1, host_pages=ids(10, 11))      # store 1, 2
    idx.insert(k2, t2, host_pages=ids(20, 21))
    idx.match(k1)                                    # touch 1
    idx.insert(k3, t3, host_pages=ids(30, 31))      # store 3
    assert freed_by_tier(idx.evict(HOST, 1)) == {(HOST, None): (k2, [20, 21])}   # 2 goes
    assert freed_by_tier(idx.evict(HOST, 1)) == {(HOST, None): (k1, [10, 11])}
    assert idx.match(k3).host_len == 2
    check_invariants(idx)


def test_eviction_order_is_lfu_with_lfu_policy():
    idx = make_index(LfuPolicy())
    k1, t1 = seq(1)
    k2, t2 = seq(2)
    idx.insert(k1, t1, host_pages=ids(1))
    n2 = idx.insert(k2, t2, host_pages=ids(2)).nodes[-1]
    idx.match(k1)
    idx.match(k1)
    idx.match(k2)                        # 2 is more recent, 1 more frequent
    assert idx.peek_evictable(HOST) == (0, (1, n2.last_access))
    assert freed_by_tier(idx.evict(HOST, 1)) == {(HOST, None): (k2, [2])}


def test_eviction_never_takes_locked_or_inner_nodes():
    idx = make_index()
    kp, tp = seq(1, 2, 3)
    kq, tq = seq(1, 2, 4)
    kr, tr = seq(1, 2, 5)
    for k, t, base in ((kp, tp, 10), (kq, tq, 20), (kr, tr, 30)):
        idx.insert(k, t, engine=0, device_pages=ids(base, base + 1, base + 2))
    locked = idx.match(kq, engine=0).last_node
    idx.lock(locked, DEV, engine=0)
    freed = freed_by_tier(idx.evict(DEV, 100, engine=0))
    # Both unlocked leaves went; the shared inner node is locked through its child.
    assert sorted(freed[(DEV, 0)][1]) == [12, 32]
    m = idx.match(kq, engine=0)
    assert m.device_pages.tolist() == [10, 11, 22]
    check_invariants(idx, [(locked, DEV, 0)])
    idx.unlock(locked, DEV, engine=0)
    # Now the leaf goes first, then its parent, which became a leaf.
    (f,) = idx.evict(DEV, 1, engine=0)
    assert f.slots.tolist() == [22]
    (f,) = idx.evict(DEV, 1, engine=0)
    assert f.slots.tolist() == [10, 11]
    check_invariants(idx)


def test_evict_takes_whole_nodes_until_enough():
    idx = make_index()
    for i in range(4):
        k, t = seq(i, i, i)
        idx.insert(k, t, host_pages=ids(3 * i, 3 * i + 1, 3 * i + 2))
    freed = freed_by_tier(idx.evict(HOST, 4))
    assert sorted(freed[(HOST, None)][1]) == [0, 1, 2, 3, 4, 5]   # two nodes of 3 pages
    assert idx.num_pages(HOST) == 6
    assert len(freed_by_tier(idx.evict(HOST, 100))[(HOST, None)][1]) == 6
    assert idx.evict(HOST, 1) == []


def test_node_evicted_from_device_keeps_host_copy_and_matches_as_host_hit():
    idx = make_index()
    k, t = seq(1, 2)
    node = idx.insert(k, t, engine=0, device_pages=ids(5, 6), host_pages=ids(50, 51)).nodes[-1]
    assert freed_by_tier(idx.evict(DEV, 1, engine=0)) == {(DEV, 0): (k, [5, 6])}
    m = idx.match(k, engine=0)
    assert (m.device_len, m.host_pages.tolist()) == (0, [50, 51])
    assert m.host_nodes == [node] and not node.removed
    # Loaded back onto the device: the daemon records the new device pages.
    assert idx.set_device(node, 0, ids(8, 9)).tolist() == []
    assert idx.match(k, engine=0).device_pages.tolist() == [8, 9]
    check_invariants(idx)


def test_two_engines_device_residency_is_independent():
    idx = make_index()
    k, t = seq(1, 2, 3)
    r0 = idx.insert(k, t, engine=0, device_pages=ids(1, 2, 3))
    r1 = idx.insert(k, t, engine=1, device_pages=ids(7, 8, 9))
    assert r1.present_pages == 3 and r1.dup_device_pages.tolist() == []
    assert r0.nodes[-1] is r1.nodes[-1]
    idx.evict(DEV, 3, engine=0)
    assert idx.match(k, engine=0).num_pages == 0
    assert idx.match(k, engine=1).device_pages.tolist() == [7, 8, 9]
    assert idx.num_pages(DEV) == 3 and idx.num_pages(DEV, 0) == 0
    check_invariants(idx)


def test_insert_returns_duplicates_and_adopts_where_absent():
    idx = make_index()
    k, t = seq(1, 2, 3, 4)
    idx.insert(k[:2], t[:8], engine=0, device_pages=ids(1, 2), host_pages=ids(60, 61))
    idx.insert(k[:3], t[:12], host_pages=ids(70, 71, 72))          # host: 2 dups, 1 new
    r = idx.insert(k, t, engine=0, device_pages=ids(11, 12, 13, 14), host_pages=ids(80, 81, 82, 83),
                   on_disk=True)
    assert r.present_pages == 3
    assert r.dup_device_pages.tolist() == [11, 12]                  # engine 0 had pages 1-2
    assert r.dup_host_pages.tolist() == [80, 81, 82]                # host had pages 1-3
    m = idx.match(k, engine=0)
    assert m.device_pages.tolist() == [1, 2, 13, 14]                # adopted pages 3-4
    assert idx.match(k).host_pages.tolist() == [60, 61, 72, 83]
    assert all(n.on_disk for n in r.nodes)
    check_invariants(idx)


def test_passing_back_the_matched_prefix_is_not_a_duplicate():
    # SGLang-style: the engine's pages for a finished request are the prefix it got
    # from match followed by its own new pages; only foreign ids are duplicates.
    idx = make_index()
    k, t = seq(1, 2, 3, 4)
    idx.insert(k[:2], t[:8], engine=0, device_pages=ids(1, 2), host_pages=ids(8, 9))
    m = idx.match(k, engine=0)
    mine = np.concatenate([m.device_pages, ids(30, 31)])
    r = idx.insert(k, t, engine=0, device_pages=mine, host_pages=ids(8, 77, 50, 51))
    assert r.dup_device_pages.tolist() == []
    assert r.dup_host_pages.tolist() == [77]
    node = r.nodes[-1]
    assert idx.set_device(node, 0, ids(1, 2, 30, 99)).tolist() == [99]
    check_invariants(idx)


def test_evicting_the_last_tier_removes_the_subtree_and_reports_all_of_it():
    idx = make_index()
    kx, tx = seq(1, 2)
    ky, ty = seq(1, 2, 3)
    kz, tz = seq(1, 2, 4)
    x = idx.insert(kx, tx, engine=0, device_pages=ids(5, 6)).nodes[-1]
    idx.insert(ky, ty, on_disk=True)                    # child y: disk only
    r = idx.insert(kz, tz, host_pages=ids(40, 41, 42))  # child z: host only
    assert r.dup_host_pages.size == 0
    idx.set_disk(x, False)                              # the inserts also covered x's pages:
    idx.clear_host(x)                                   # x is device only again
    assert x.lanes() == [0] and idx.take_freed() == []
    freed = freed_by_tier(idx.evict(DEV, 1, engine=0))
    assert freed == {
        (DEV, 0): (kx, [5, 6]),
        (DISK, None): (ky[2:], []),
        (HOST, None): (kz[2:], [42]),
    }
    assert x.removed and list(idx.iter_nodes()) == []
    assert idx.num_pages(HOST) == idx.num_pages(DISK) == idx.num_pages(DEV) == 0
    assert idx.match(kz).num_pages == 0
    check_invariants(idx)


def test_a_lock_below_keeps_a_node_whose_eviction_would_remove_it():
    idx = make_index()
    kx, tx = seq(1, 2)
    kz, tz = seq(1, 2, 4)
    x = idx.insert(kx, tx, engine=0, device_pages=ids(5, 6)).nodes[-1]
    z = idx.insert(kz, tz, host_pages=ids(40, 41, 42)).nodes[-1]
    idx.clear_host(x)
    idx.lock(z, HOST)                      # a host->device load of z is in flight
    assert idx.evict(DEV, 10, engine=0) == []
    idx.unlock(z, HOST)
    assert idx.evict(DEV, 10, engine=0) != []
    assert z.removed


def test_remove_engine_drops_its_residency_and_a_locked_orphan_waits_for_unlock():
    idx = make_index()
    kx, tx = seq(1, 2)
    kz, tz = seq(1, 2, 4)
    x = idx.insert(kx, tx, engine=0, device_pages=ids(5, 6)).nodes[-1]
    idx.insert(kx, tx, engine=1, device_pages=ids(7, 8))
    z = idx.insert(kz, tz, host_pages=ids(40, 41, 42)).nodes[-1]
    idx.clear_host(x)
    idx.lock(x, DEV, engine=0)
    idx.lock(z, HOST)
    freed = freed_by_tier(idx.remove_engine(0))
    assert freed == {(DEV, 0): (kx, [5, 6])}
    assert x.lock_ref == [0, 1, 0] and 0 not in x.device_locks   # engine 0's locks are gone
    idx.remove_engine(1)
    # x is in no tier but z below it is locked: x stays, and match stops at it.
    assert not x.removed and not x.in_any_tier
    assert idx.match(kz).num_pages == 0
    check_invariants(idx, [(z, HOST, None)])
    idx.unlock(z, HOST)
    assert x.removed and z.removed
    assert freed_by_tier(idx.take_freed()) == {(HOST, None): (kz[2:], [42])}
    assert idx.take_freed() == []
    check_invariants(idx)


def test_flush_drops_a_tier_but_keeps_locked_nodes():
    idx = make_index()
    ka, ta = seq(1, 2)
    kb, tb = seq(3, 4)
    a = idx.insert(ka, ta, host_pages=ids(1, 2), on_disk=True).nodes[-1]
    b = idx.insert(kb, tb, host_pages=ids(3, 4)).nodes[-1]
    idx.lock(a, HOST)
    freed = freed_by_tier(idx.flush(HOST))
    assert freed == {(HOST, None): (kb, [3, 4])}
    assert b.removed and a.host is not None
    idx.unlock(a, HOST)
    assert freed_by_tier(idx.flush(HOST)) == {(HOST, None): (ka, [1, 2])}
    assert idx.match(ka).disk_keys == ka                # still on disk
    check_invariants(idx)


def test_set_device_after_a_split_covers_the_whole_range_the_caller_matched():
    idx = make_index()
    k, t = seq(1, 2, 3, 4)
    kb, tb = seq(1, 2, 9)
    idx.insert(k, t, host_pages=ids(0, 1, 2, 3))
    m = idx.match(k, engine=0)
    (node,) = m.host_nodes
    idx.lock(node, HOST)
    idx.insert(kb, tb, host_pages=ids(4, 5, 6))     # splits the node while the load runs
    assert node.n_pages == 2
    assert idx.set_device(node, 0, ids(10, 11, 12, 13)).tolist() == []
    idx.unlock(node, HOST)
    assert idx.match(k, engine=0).device_pages.tolist() == [10, 11, 12, 13]
    assert idx.match(kb, engine=0).device_pages.tolist() == [10, 11]
    check_invariants(idx)


def test_set_host_and_set_disk_on_a_path_suffix_split_the_top_node():
    idx = make_index()
    k, t = seq(1, 2, 3)
    node = idx.insert(k, t, engine=0, device_pages=ids(1, 2, 3)).nodes[-1]
    assert idx.set_host(node, ids(30, 31)).tolist() == []
    assert node.n_pages == 2 and node.parent.host is None
    assert idx.set_host(node, ids(40, 41)).tolist() == [40, 41]   # already there
    idx.set_disk(node, True, num_pages=1)
    assert node.n_pages == 1 and node.on_disk and not node.parent.on_disk
    m = idx.match(k)
    assert (m.host_len, m.disk_len) == (0, 0)      # page 1 is on engine 0 only
    check_invariants(idx)


def test_peek_and_select_victims_do_not_evict():
    idx = make_index()
    k1, t1 = seq(1)
    k2, t2 = seq(2)
    n1 = idx.insert(k1, t1, host_pages=ids(1)).nodes[-1]
    n2 = idx.insert(k2, t2, host_pages=ids(2)).nodes[-1]
    assert idx.peek_evictable(HOST) == (0, n1.last_access)
    assert idx.select_victims(HOST, 1) == [n1]
    assert idx.select_victims(HOST, 2) == [n1, n2]
    idx.match(k1)
    assert idx.peek_evictable(HOST) == (0, n2.last_access)
    assert idx.num_pages(HOST) == 2
    check_invariants(idx)


def test_unlock_below_zero_and_clearing_locked_residency_raise():
    idx = make_index()
    k, t = seq(1)
    node = idx.insert(k, t, engine=0, device_pages=ids(1), host_pages=ids(2)).nodes[-1]
    with pytest.raises(IndexStateError):
        idx.unlock(node, HOST)
    idx.lock(node, HOST)
    idx.lock(node, DEV, engine=0)
    with pytest.raises(IndexStateError):
        idx.unlock(node, DEV, engine=1)
    with pytest.raises(IndexStateError):
        idx.clear_host(node)
    with pytest.raises(IndexStateError):
        idx.clear_device(node, 0)
    check_invariants(idx, [(node, HOST, None), (node, DEV, 0)])


def test_operations_on_a_removed_node_raise():
    idx = make_index()
    k, t = seq(1)
    node = idx.insert(k, t, host_pages=ids(1)).nodes[-1]
    idx.evict(HOST, 1)
    assert node.removed and node.host is None      # stale holders see no freed ids
    for call in (lambda: idx.lock(node, HOST), lambda: idx.set_host(node, ids(3)),
                 lambda: idx.clear_device(node, 0)):
        with pytest.raises(IndexStateError):
            call()


def test_the_state_checkpoint_stays_with_the_lower_half():
    idx = make_index()
    k, t = seq(1, 2, 3)
    node = idx.insert(k, t, host_pages=ids(1, 2, 3)).nodes[-1]
    node.state = "ckpt@3"
    idx.match(k[:1])
    assert node.state == "ckpt@3" and node.parent.state is None


def test_empty_insert_and_match_are_noops():
    idx = make_index()
    r = idx.insert([], np.empty(0, np.int32))
    assert r.present_pages == 0 and r.nodes == []
    m = idx.match([], engine=0)
    assert m.num_pages == 0 and m.last_node is idx.root


def test_stale_heap_entries_are_compacted():
    idx = make_index()
    for i in range(500):
        # Each node is queued in the device heap, then stops being a device candidate
        # without that heap ever being popped: its entry goes stale.
        k, t = seq(i)
        node = idx.insert(k, t, engine=0, device_pages=ids(i), host_pages=ids(i)).nodes[-1]
        assert 0 in node.queued
        idx.clear_device(node, 0)
        idx.evict(HOST, 1)
    assert idx.num_pages(DEV, 0) == 0
    assert len(idx._ledger.candidates.heaps[0]) <= 64 + 1
    check_invariants(idx)
