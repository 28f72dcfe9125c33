"""Keyed chains in RadixIndex (hicache/index/key_map.py): any key found in one lookup,
splits and removals followed, late parents adopting chain roots, named pages rebuilt."""

from __future__ import annotations

import numpy as np

from hicache.index.keys import page_keys
from hicache.index.radix import Tier
from radix_util import PS, SALT, check_invariants, ids, make_index

HOST = Tier.HOST


def named(*labels: int) -> tuple[list[bytes], list[np.ndarray]]:
    """Pages keyed from the salt alone, as hicache.client.keyed names them."""
    toks = [np.full(PS, label, dtype=np.int32) for label in labels]
    return [page_keys(SALT, t, PS)[0] for t in toks], toks


def chain(idx, labels, slots, parent=None):
    """Hang named pages one below the other, as a keyed store's commit does."""
    keys, toks = named(*labels)
    node = parent or idx.root
    out = []
    for k, t, s in zip(keys, toks, slots):
        node = idx.extend_host(node, [k], t, ids(s)).nodes[-1]
        out.append(node)
    return keys, out


def test_every_key_of_a_path_is_found_and_a_split_is_followed_upwards():
    idx = make_index()
    idx.enable_key_map()
    keys, toks = named(1, 2, 3, 4)
    idx.extend_host(idx.root, keys, np.concatenate(toks), ids(10, 11, 12, 13))  # one 4-page node
    node = idx.find_key(keys[2])
    assert node.keys == keys and node.host.tolist() == [10, 11, 12, 13]
    upper = idx.find_key(keys[1], split=True)  # the chain continues below page 2
    assert upper.keys == keys[:2] and upper.host.tolist() == [10, 11]
    assert idx.find_key(keys[0]) is upper and idx.find_key(keys[3]).keys == keys[2:]
    check_invariants(idx)


def test_a_removed_page_is_a_miss():
    idx = make_index()
    idx.enable_key_map()
    keys, nodes = chain(idx, [1, 2], [5, 6])
    idx.evict(HOST, 1)
    assert idx.find_key(keys[1]) is None and idx.find_key(keys[0]) is nodes[0]
    idx.evict(HOST, 1)
    assert idx.find_key(keys[0]) is None
    check_invariants(idx)


def test_a_chain_root_adopted_by_its_late_parent_is_evicted_before_it():
    idx = make_index()
    idx.enable_key_map()
    _, tail = chain(idx, [3, 4], [7, 8])  # stored first: its parent was unknown
    _, head = chain(idx, [1, 2], [5, 6])
    assert idx.adopt(head[-1], tail[0])
    assert tail[0].parent is head[-1] and tail[0].keys[0] in head[-1].children
    check_invariants(idx)
    freed = idx.evict(HOST, 2)  # the tail is older, yet only leaves go: page 4, then page 3
    assert [k for f in freed for k in f.keys] == [*tail[1].keys, *tail[0].keys]
    assert not head[-1].removed
    check_invariants(idx)


def test_adopt_refuses_what_does_not_fit_and_changes_nothing():
    idx = make_index()
    idx.enable_key_map()
    _, a = chain(idx, [1, 2], [5, 6])
    _, b = chain(idx, [3], [7])
    assert not idx.adopt(a[1], a[0])  # its own descendant: a cycle
    assert not idx.adopt(b[0], a[1])  # not a chain root
    idx.lock(b[0], HOST)
    assert not idx.adopt(a[1], b[0])  # locked: a pin holds its path
    idx.unlock(b[0], HOST)
    assert b[0].parent is idx.root and a[0].parent is idx.root
    check_invariants(idx)


def test_a_chain_of_named_pages_is_rebuilt_from_disk_and_a_corrupt_one_is_not():
    keys, toks = named(1, 2, 3)
    bad = np.full(PS, 9, dtype=np.int32)
    records = [(keys[0], SALT, toks[0], 1.0), (keys[1], keys[0], toks[1], 2.0), (keys[2], keys[1], toks[2], 3.0),
               (page_keys(SALT, bad, PS)[0], keys[2], toks[0], 4.0)]  # its key does not match its tokens
    idx = make_index()
    orphans: list[bytes] = []
    assert idx.restore_disk(records, orphans) == 3
    assert orphans == [records[3][0]]
    assert idx.match(keys).disk_len == 3  # one path, the chain's order
    check_invariants(idx)
