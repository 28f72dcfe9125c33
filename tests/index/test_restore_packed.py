"""The restore of packed records (the disk tier's scan) against the restore of tuples: the
same tree, the same records left out, with the check and chaining in C or in Python."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from hicache.index import native_index, restore
from hicache.index.keys import page_keys
from hicache.index.node import Tier
from hicache.index.restore import PackedRecords
from radix_util import PS, SALT, all_nodes, check_invariants, make_index, path_to

NATIVE = native_index.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the index's C module is not built here")


def packed(records) -> PackedRecords:
    return PackedRecords(np.frombuffer(b"".join(r[0] for r in records), np.uint8).reshape(-1, 16),
                         np.frombuffer(b"".join(r[1] for r in records), np.uint8).reshape(-1, 16),
                         np.array([r[2] for r in records], dtype="<i4").reshape(-1, PS),
                         np.array([r[3] for r in records], dtype=np.float64))


def random_records(rng: random.Random, n_seqs: int):
    """Records of branching sequences, plus orphans, torn pages (tokens that do not hash to
    the key) with children, a named page (keyed engines) and a duplicate key."""
    out: dict[bytes, tuple] = {}
    prompts: list[np.ndarray] = []
    for n in range(n_seqs):
        base = prompts[rng.randrange(len(prompts))] if prompts and rng.random() < 0.7 else np.empty(0, np.int32)
        cut = rng.randrange(len(base) // PS + 1) * PS
        toks = np.concatenate([base[:cut], np.array([rng.randrange(1 << 20) for _ in range(PS * rng.randrange(1, 6))],
                                                    dtype=np.int32)])
        prompts.append(toks)
        keys = page_keys(SALT, toks, PS)
        for i, k in enumerate(keys):
            out.setdefault(k, (k, SALT if i == 0 else keys[i - 1], toks[i * PS:(i + 1) * PS], float(n + i)))
    recs = list(out.values())
    extra = []
    for r in rng.sample(recs, 3):  # torn: its tokens no longer hash to its key; its children go too
        extra.append((r[0], r[1], r[2] + 1, r[3]))
        recs.remove(r)
    gone = rng.sample(recs, 2)  # their children become orphans
    for r in gone:
        recs.remove(r)
    named_toks = np.arange(PS, dtype=np.int32) + 7
    named = hashlib.blake2b(SALT + named_toks.tobytes(), digest_size=16).digest()
    extra.append((named, recs[0][0], named_toks, 1.0))  # a named page, chained below a kept one
    recs = recs + extra
    rng.shuffle(recs)
    return recs


def shape(idx):
    return sorted((tuple(k for p in path_to(x) for k in p.keys), x.last_access, x.tokens.tobytes())
                  for x in all_nodes(idx))


@needs_native
@pytest.mark.parametrize("seed,n_seqs", [(s, 60) for s in range(6)] + [(6, 2500)])  # 2500: checked on threads
def test_packed_records_restore_the_tree_restore_disk_builds(seed, n_seqs):
    recs = random_records(random.Random(seed), n_seqs)
    by_tuples, by_arrays = make_index(), make_index()
    left_t: list[bytes] = []
    left_a: list[bytes] = []
    n_t = by_tuples.restore_disk(recs, left_t)
    n_a = by_arrays.restore_packed(packed(recs), left_a)
    assert n_a == n_t > 0 and left_t and sorted(left_a) == sorted(left_t)
    assert shape(by_arrays) == shape(by_tuples)
    assert by_arrays.num_pages(Tier.DISK) == n_a
    check_invariants(by_arrays)


def test_without_the_c_module_packed_records_go_through_the_python_check(monkeypatch):
    recs = random_records(random.Random(11), 30)
    ref = make_index()
    left_ref: list[bytes] = []
    n_ref = ref.restore_disk(recs, left_ref)
    monkeypatch.setattr(restore.native_index, "load", lambda: None)
    idx = make_index()
    left: list[bytes] = []
    assert idx.restore_packed(packed(recs), left) == n_ref
    assert sorted(left) == sorted(left_ref) and shape(idx) == shape(ref)


@needs_native
def test_a_repeated_key_counts_once_and_is_not_left_out():
    keys = page_keys(SALT, np.arange(2 * PS, dtype=np.int32), PS)
    toks = np.arange(2 * PS, dtype=np.int32).reshape(2, PS)
    recs = [(keys[0], SALT, toks[0], 1.0), (keys[1], keys[0], toks[1], 2.0), (keys[0], SALT, toks[0], 3.0)]
    idx = make_index()
    left: list[bytes] = []
    assert idx.restore_packed(packed(recs), left) == 2 and left == []
    (node,) = all_nodes(idx)
    assert node.n_pages == 2 and node.last_access == 2.0


@needs_native
def test_packed_records_merge_into_a_live_tree():
    idx = make_index()
    toks = np.arange(4 * PS, dtype=np.int32)
    keys = page_keys(SALT, toks, PS)
    idx.insert(keys[:2], toks[:2 * PS], engine=0, device_pages=np.array([5, 6], dtype=np.int64))
    recs = [(k, SALT if i == 0 else keys[i - 1], toks[i * PS:(i + 1) * PS], float(i)) for i, k in enumerate(keys)]
    assert idx.restore_packed(packed(recs)) == 4
    m = idx.match(keys, engine=0)
    assert m.device_pages.tolist() == [5, 6] and m.disk_keys == keys[2:]
    check_invariants(idx)


@needs_native
def test_bad_shapes_are_refused_by_the_c_check():
    n = np.empty(1, np.int64)
    with pytest.raises(ValueError, match="records"):
        NATIVE.chain_runs(b"x" * 16, b"x" * 15, b"", 0, SALT, n, n, n, n)
    with pytest.raises(ValueError, match="room"):
        NATIVE.chain_runs(b"x" * 32, b"x" * 32, b"", 0, SALT, n, n, n, n)


@needs_native
@pytest.mark.parametrize("size", [0, 1, 111, 112, 113, 127, 128, 129, 240, 1024])
def test_the_c_blake2b_is_hashlibs(size):
    prefix, data = random.Random(size).randbytes(16), random.Random(-size).randbytes(size)
    assert NATIVE.page_key(prefix, data) == hashlib.blake2b(prefix + data, digest_size=16).digest()


@needs_native
def test_runs_below_a_parent_evicted_between_two_steps_are_left_out():
    """hang_steps lets the daemon answer between runs; a parent evicted from disk meanwhile
    takes what hangs below it out too (a page is on disk only below its parent)."""
    toks = np.arange(6 * PS, dtype=np.int32)
    trunk = page_keys(SALT, toks[:2 * PS], PS)
    left_branch = page_keys(SALT, toks[2 * PS:4 * PS], PS, parent=trunk[-1])
    right_toks = toks[4 * PS:6 * PS] + 1000
    right_branch = page_keys(SALT, right_toks, PS, parent=trunk[-1])
    recs = [(k, SALT if i == 0 else trunk[0], toks[i * PS:(i + 1) * PS], 1.0) for i, k in enumerate(trunk)]
    for branch, bt in ((left_branch, toks[2 * PS:4 * PS]), (right_branch, right_toks)):
        recs += [(k, trunk[-1] if i == 0 else branch[0], bt[i * PS:(i + 1) * PS], 1.0) for i, k in enumerate(branch)]
    idx = make_index()
    chained = restore.chain_packed(packed(recs), SALT, PS)
    orphans: list[bytes] = []
    steps = restore.hang_steps(idx, chained, orphans)
    assert next(steps) == 2  # the trunk, one run
    (node,) = all_nodes(idx)
    idx.set_disk(node, False)  # evicted: in no tier, it leaves the tree
    assert node.removed and list(steps) == []  # nothing more hangs
    assert sorted(orphans) == sorted(left_branch + right_branch) and all_nodes(idx) == []
    check_invariants(idx)
