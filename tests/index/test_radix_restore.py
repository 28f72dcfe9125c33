"""Rebuilding the disk part of the tree from per-page records after a restart."""

from __future__ import annotations

import random

import numpy as np

from hicache.index.node import DiskRecord, Tier
from radix_util import PS, SALT, all_nodes, check_invariants, ids, make_index, path_to, seq

SEQS = [(1, 2, 3, 4), (1, 2, 3, 5, 6), (1, 2, 7), (8,), (8, 9, 10, 11, 12)]


def records_of(sequences, start_time=100.0):
    """Per-page records as the disk tier keeps them; page i of a sequence last used at
    start_time + i (shared pages get the latest)."""
    out: dict[bytes, DiskRecord] = {}
    for n, pages in enumerate(sequences):
        keys, tokens = seq(*pages)
        for i, key in enumerate(keys):
            parent = SALT if i == 0 else keys[i - 1]
            la = start_time + 10 * n + i
            if key not in out or out[key].last_access < la:
                out[key] = DiskRecord(key, parent, tokens[i * PS:(i + 1) * PS], la)
    return list(out.values())


def shape(idx):
    return sorted(tuple(k for p in path_to(x) for k in p.keys) for x in all_nodes(idx))


def test_restore_from_shuffled_records_rebuilds_the_tree_and_match_finds_disk_hits():
    records = records_of(SEQS)
    random.Random(7).shuffle(records)
    idx = make_index()
    assert idx.restore_disk(records) == len(records) == 12
    for pages in SEQS:
        keys, _ = seq(*pages)
        m = idx.match(keys, engine=0)
        assert (m.device_len, m.host_len, m.disk_keys) == (0, 0, keys)
    # Same shape as inserting the sequences; single-child chains became one node.
    ref = make_index()
    for pages in SEQS:
        ref.insert(*seq(*pages), on_disk=True)
    assert shape(idx) == shape(ref)
    assert idx.num_pages(Tier.DISK) == 12
    check_invariants(idx)


def test_restored_nodes_carry_the_newest_access_time_of_their_pages():
    idx = make_index()
    idx.restore_disk(records_of([(1, 2, 3)], start_time=50.0))
    (node,) = all_nodes(idx)
    assert node.n_pages == 3 and node.last_access == 52.0 and node.hit_count == 0


def test_orphans_corrupt_and_malformed_records_are_skipped_and_reported():
    records = records_of(SEQS)
    keys9, tokens9 = seq(1, 2, 9, 9)
    orphan_parent = bytes(16)
    # A page whose parent was never written, and its child.
    o1 = DiskRecord(keys9[2], orphan_parent, tokens9[8:12], 1.0)
    o2 = DiskRecord(keys9[3], keys9[2], tokens9[12:16], 1.0)
    # A page whose tokens do not hash to its key (torn write), and its child.
    kc, tc = seq(20, 21)
    bad = DiskRecord(kc[0], SALT, tc[:PS] + 1, 1.0)
    below_bad = DiskRecord(kc[1], kc[0], tc[PS:], 1.0)
    malformed = [DiskRecord(b"short", SALT, tc[:PS], 1.0), (kc[1],), DiskRecord(keys9[0], SALT, tc[:2], 1.0)]
    mixed = records + [o1, o2, bad, below_bad] + malformed
    random.Random(3).shuffle(mixed)
    idx = make_index()
    orphans: list[bytes] = []
    assert idx.restore_disk(mixed, orphans) == 12
    assert sorted(orphans) == sorted([keys9[2], keys9[3], kc[0], kc[1]])
    assert idx.match(kc).num_pages == 0
    assert idx.match(keys9).disk_len == 2
    check_invariants(idx)


def test_restore_merges_into_a_live_tree():
    idx = make_index()
    keys, tokens = seq(1, 2, 3, 4)
    node = idx.insert(keys[:2], tokens[:2 * PS], engine=0, device_pages=ids(5, 6)).nodes[-1]
    before = node.last_access
    assert idx.restore_disk(records_of([(1, 2, 3, 4)], start_time=0.0)) == 4
    m = idx.match(keys, engine=0)
    assert m.device_pages.tolist() == [5, 6] and m.disk_keys == keys[2:]
    assert node.on_disk and node.device[0].tolist() == [5, 6]
    assert node.last_access > before  # the match; restore itself did not age it
    check_invariants(idx)


def test_restore_accepts_plain_tuples_and_lists_of_tokens():
    keys, tokens = seq(4, 5)
    recs = [(keys[1], keys[0], tokens[PS:].tolist(), 2), (keys[0], SALT, tokens[:PS].tolist(), 1)]
    idx = make_index()
    assert idx.restore_disk(iter(recs)) == 2
    assert idx.match(keys).disk_keys == keys
    assert all_nodes(idx)[0].tokens.dtype == np.int32
