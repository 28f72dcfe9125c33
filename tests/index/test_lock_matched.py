"""RadixIndex.lock_matched (the daemon's match locks through the path the walk took)
leaves the same tree, refs and counts as lock() on the segment's last node, on random
trees; and it refuses, changing nothing, a result it cannot trust."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicache.index.node import Tier
from hicache.index.radix import IndexInputError, IndexStateError
from radix_util import check_invariants, ids, make_index, seq, snapshot

ENGINES = (0, 1)


def random_ops(rng: random.Random) -> list[tuple]:
    """Inserts of sequences sharing prefixes, each with a random residency."""
    ops = []
    next_page = {e: 1 for e in ENGINES}
    next_slot = 1
    for _ in range(rng.randint(3, 12)):
        pages = [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
        engine = rng.choice(ENGINES)
        n = len(pages)
        dev = host = None
        if rng.random() < 0.7:
            dev = np.arange(next_page[engine], next_page[engine] + n)
            next_page[engine] += n
        if rng.random() < 0.5 or dev is None:
            host = np.arange(next_slot, next_slot + n)
            next_slot += n
        ops.append((pages, engine, dev, host, rng.random() < 0.3))
    return ops


def build(ops: list[tuple]):
    idx = make_index()
    for pages, engine, dev, host, disk in ops:
        keys, toks = seq(*pages)
        idx.insert(keys, toks, engine=engine, device_pages=dev, host_pages=host, on_disk=disk)
    return idx


@pytest.mark.parametrize("seed", range(40))
def test_lock_matched_equals_lock_on_random_trees(seed):
    rng = random.Random(seed)
    ops = random_ops(rng)
    by_walk, by_lock = build(ops), build(ops)
    held_walk, held_lock = [], []
    for _ in range(6):
        query = [rng.randint(1, 3) for _ in range(rng.randint(1, 9))]
        engine = rng.choice(ENGINES)
        keys, _ = seq(*query)
        rw, rl = by_walk.match(keys, engine), by_lock.match(keys, engine)
        n_dev, n_host = len(rw.device_nodes), len(rw.host_nodes)
        assert (n_dev, n_host) == (len(rl.device_nodes), len(rl.host_nodes))
        if n_dev:
            by_walk.lock_matched(rw, n_dev, Tier.DEVICE, engine)
            by_lock.lock(rl.device_nodes[-1], Tier.DEVICE, engine)
            held_walk.append((rw.device_nodes[-1], Tier.DEVICE, engine))
            held_lock.append((rl.device_nodes[-1], Tier.DEVICE, engine))
        if n_host:
            by_walk.lock_matched(rw, n_dev + n_host, Tier.HOST)
            by_lock.lock(rl.host_nodes[-1], Tier.HOST)
            held_walk.append((rw.host_nodes[-1], Tier.HOST, None))
            held_lock.append((rl.host_nodes[-1], Tier.HOST, None))
        assert snapshot(by_walk) == snapshot(by_lock)
    check_invariants(by_walk, held_walk)
    for node, tier, engine in held_walk:  # what lock_matched took, unlock gives back
        by_walk.unlock(node, tier, engine)
    for node, tier, engine in held_lock:
        by_lock.unlock(node, tier, engine)
    assert snapshot(by_walk) == snapshot(by_lock)
    check_invariants(by_walk)


def test_lock_matched_refuses_bad_counts_foreign_and_stale_results_changing_nothing():
    idx, other = make_index(), make_index()
    keys, toks = seq(1, 2, 3)
    for x in (idx, other):
        x.insert(keys, toks, engine=0, device_pages=ids(1, 2, 3))
    r = idx.match(keys, 0)
    before = snapshot(idx)
    for bad in (0, -1, len(r.nodes) + 1):
        with pytest.raises(IndexInputError):
            idx.lock_matched(r, bad, Tier.DEVICE, 0)
    with pytest.raises(IndexInputError):
        idx.lock_matched(r, 1, "device", 0)
    with pytest.raises(IndexStateError):  # a result of another index
        other.lock_matched(r, 1, Tier.DEVICE, 0)
    assert snapshot(idx) == before
    idx.evict(Tier.DEVICE, 3, 0)  # the matched node goes with its only copy
    gone = snapshot(idx)
    with pytest.raises(IndexStateError):
        idx.lock_matched(r, 1, Tier.DEVICE, 0)
    assert snapshot(idx) == gone
    check_invariants(idx)
