"""RadixIndex.lock_match (the daemon's match locks through the path the walk took)
leaves the same tree, refs and counts as lock() on each segment's last node, on random
trees, and unlock_held gives them back; it refuses, changing nothing, a result it
cannot trust."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicache.index.node import Tier
from hicache.index.radix import IndexStateError
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
def test_lock_match_equals_lock_on_random_trees(seed):
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
        held_walk += by_walk.lock_match(rw, engine)
        if n_dev:
            by_lock.lock(rl.device_nodes[-1], Tier.DEVICE, engine)
            held_lock.append((rl.device_nodes[-1], Tier.DEVICE, engine))
        if n_host:
            by_lock.lock(rl.host_nodes[-1], Tier.HOST)
            held_lock.append((rl.host_nodes[-1], Tier.HOST, None))
        assert snapshot(by_walk) == snapshot(by_lock)
    check_invariants(by_walk, held_walk)
    by_walk.unlock_held(held_walk)  # what lock_match took, unlock_held gives back
    for node, tier, engine in held_lock:
        by_lock.unlock(node, tier, engine)
    assert snapshot(by_walk) == snapshot(by_lock)
    check_invariants(by_walk)


def test_lock_match_refuses_foreign_and_stale_results_changing_nothing():
    idx, other = make_index(), make_index()
    keys, toks = seq(1, 2, 3)
    for x in (idx, other):
        x.insert(keys, toks, engine=0, device_pages=ids(1, 2, 3))
    r = idx.match(keys, 0)
    before = snapshot(idx)
    with pytest.raises(IndexStateError):  # a result of another index
        other.lock_match(r, 0)
    assert snapshot(idx) == before
    idx.evict(Tier.DEVICE, 3, 0)  # the matched node goes with its only copy
    gone = snapshot(idx)
    with pytest.raises(IndexStateError):
        idx.lock_match(r, 0)
    assert snapshot(idx) == gone
    check_invariants(idx)


def test_lock_match_of_a_miss_takes_no_lock():
    idx = make_index()
    keys, toks = seq(1, 2)
    idx.insert(keys, toks, engine=0, device_pages=ids(1, 2))
    before = snapshot(idx)
    assert idx.lock_match(idx.match(seq(5)[0], 0), 0) == []
    assert snapshot(idx)[1:] == before[1:]  # counts unchanged (the walk touched nothing)
    check_invariants(idx)
