"""The radix walk and lock loops in C (hicache/index/native_index.py) against Python: two
indexes built alike, one with the C loops and one in Python, take the same random
matches (with the locks the daemon takes on them), releases, evictions, inserts and
disk marks, interleaved; every result and the whole tree must stay identical.
Under CI=true the C loops must have been built."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from hicache.index import native_index
from hicache.index.keys import PackedKeys
from hicache.index.node import IndexInputError, IndexStateError, Tier
from radix_util import check_invariants, make_index, seq, snapshot

ENGINES = (0, 1)

needs_native = pytest.mark.skipif(native_index.load() is None and os.environ.get("CI") != "true",
                                  reason=f"native walk: {native_index.unavailable_reason()}")


def test_native_loops_are_built_under_ci():
    if os.environ.get("CI") == "true":
        assert native_index.load() is not None, native_index.unavailable_reason()


def packed(pages: list[int]) -> PackedKeys:
    return PackedKeys(b"".join(seq(*pages)[0]))


def same_result(a, b) -> None:
    assert (len(a.nodes), len(a.device_nodes), len(a.host_nodes), len(a.disk_nodes)) == \
        (len(b.nodes), len(b.device_nodes), len(b.host_nodes), len(b.disk_nodes))
    assert a.device_pages.tolist() == b.device_pages.tolist()
    assert a.host_pages.tolist() == b.host_pages.tolist()
    assert a.disk_keys == b.disk_keys
    assert [x.keys for x in a.nodes] == [x.keys for x in b.nodes]
    assert a.last_node.keys == b.last_node.keys


def same_locked(a: tuple, b: tuple) -> None:
    """Two match_locked results alike: path, segments, pages and the locks' nodes."""
    assert [x.keys for x in a[0]] == [x.keys for x in b[0]] and a[1:3] == b[1:3]
    assert a[3].tolist() == b[3].tolist() and a[4].tolist() == b[4].tolist()
    assert [(n.keys, t, e) for n, t, e in a[5]] == [(n.keys, t, e) for n, t, e in b[5]]


class Pair:
    """The same index twice: `native` walks and locks in C, `python` in Python."""

    def __init__(self) -> None:
        self.native, self.python = make_index(), make_index()
        assert self.native._native_walk is not None
        self.python.use_native(None)
        self.held: dict[int, tuple[list, list]] = {}  # request -> (native locks, python locks)
        self.next_page = {e: 1 for e in ENGINES}
        self.next_slot = 1

    def both(self, fn) -> tuple:
        return fn(self.native), fn(self.python)

    def check(self) -> None:
        assert snapshot(self.native) == snapshot(self.python)
        check_invariants(self.native, [lk for locks, _ in self.held.values() for lk in locks])

    def insert(self, rng: random.Random) -> None:
        pages = [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
        engine, n = rng.choice(ENGINES), len(pages)
        dev = host = None
        if rng.random() < 0.7:
            dev = np.arange(self.next_page[engine], self.next_page[engine] + n)
            self.next_page[engine] += n
        if rng.random() < 0.5 or dev is None:
            host = np.arange(self.next_slot, self.next_slot + n)
            self.next_slot += n
        keys, toks = seq(*pages)
        disk = rng.random() < 0.3
        ra, rb = self.both(lambda x: x.insert(keys, toks, engine=engine, device_pages=dev, host_pages=host,
                                              on_disk=disk))
        assert ra.present_pages == rb.present_pages

    def match(self, rng: random.Random, request: int) -> None:
        query = [rng.randint(1, 3) for _ in range(rng.randint(1, 9))]
        engine = rng.choice((*ENGINES, None))
        if engine is not None and rng.random() < 0.5:  # walk and lock in one call (the service's)
            ra, rb = self.both(lambda x: x.match_locked(packed(query), engine))
            same_locked(ra, rb)
            self.held[request] = (ra[5], rb[5])
            return
        ra, rb = self.both(lambda x: x.match(packed(query), engine))
        same_result(ra, rb)
        if engine is not None and rng.random() < 0.8:  # as CacheService.match_engine locks it
            self.held[request] = (self.native.lock_match(ra, engine), self.python.lock_match(rb, engine))

    def release(self, rng: random.Random) -> None:
        if self.held:
            locks_a, locks_b = self.held.pop(rng.choice(sorted(self.held)))
            self.native.unlock_held(locks_a)
            self.python.unlock_held(locks_b)
            fa, fb = self.both(lambda x: x.take_freed())
            assert [(f.tier, f.engine, f.keys) for f in fa] == [(f.tier, f.engine, f.keys) for f in fb]

    def evict(self, rng: random.Random) -> None:
        tier = rng.choice(list(Tier))
        engine = rng.choice(ENGINES) if tier is Tier.DEVICE else None
        n = rng.randint(1, 6)
        fa, fb = self.both(lambda x: x.evict(tier, n, engine))
        assert [(f.tier, f.engine, f.keys) for f in fa] == [(f.tier, f.engine, f.keys) for f in fb]


@needs_native
@pytest.mark.parametrize("seed", range(60))
def test_native_loops_equal_python_on_random_trees(seed):
    rng = random.Random(seed)
    pair = Pair()
    for _ in range(rng.randint(2, 6)):
        pair.insert(rng)
    for step in range(60):
        op = rng.random()
        if op < 0.45:
            pair.match(rng, step)
        elif op < 0.65:
            pair.release(rng)
        elif op < 0.8:
            pair.evict(rng)
        else:
            pair.insert(rng)
        pair.check()
    while pair.held:
        pair.release(rng)
    pair.check()


@needs_native
def test_native_walk_splits_where_the_request_ends_or_diverges_inside_a_node():
    pair = Pair()
    keys, toks = seq(1, 2, 3, 4)
    pair.both(lambda x: x.insert(keys, toks, engine=0, device_pages=np.arange(1, 5)))
    for query in ([1, 2], [1, 2, 3, 9], [1, 2, 3, 4, 5]):
        ra, rb = pair.both(lambda x: x.match(packed(query), 0))
        same_result(ra, rb)
        pair.check()
    assert ra.device_pages.tolist() == [1, 2, 3, 4]
    assert [x.n_pages for x in pair.native.iter_nodes()] == [x.n_pages for x in pair.python.iter_nodes()]


@needs_native
def test_match_locked_splits_before_it_locks_and_equals_match_then_lock_match():
    pair = Pair()
    keys, toks = seq(1, 2, 3, 4)
    pair.both(lambda x: x.insert(keys, toks, engine=0, device_pages=np.arange(1, 5), host_pages=np.arange(1, 5)))
    # engine 1 has no device copy: a host segment; engine 0: a device segment
    for n, (query, engine) in enumerate((([1, 2], 0), ([1, 2, 3, 9], 1), ([1, 2, 3, 4, 5], 0), ([7], 0))):
        ra, rb = pair.both(lambda x: x.match_locked(packed(query), engine))
        same_locked(ra, rb)
        pair.held[n] = (ra[5], rb[5])
        pair.check()
    # the first request locked only the upper two pages: had it locked before splitting,
    # the lower half would carry its device lock too (a split copies lock refs), and the
    # third request's lock on it would make 2
    (node, tier, engine), = pair.held[0][0]
    assert (node.n_pages, tier, engine) == (2, Tier.DEVICE, 0) and node.lock_ref[Tier.HOST] == 1
    assert node.children and all(c.device_locks.get(0, 0) == 1 for c in node.children.values())
    with pytest.raises(IndexInputError):
        pair.native.match_locked(packed([1]), -1)
    pair.check()
    while pair.held:
        pair.release(random.Random(0))
    pair.check()


@needs_native
def test_native_walk_refuses_a_malformed_tree_node():
    idx = make_index()
    keys, toks = seq(1, 2)
    idx.insert(keys, toks, engine=0, device_pages=np.arange(1, 3))
    node = next(idx.iter_nodes())
    node.keys = tuple(node.keys)  # the walk reads keys as the list the index keeps
    with pytest.raises(TypeError):
        idx.match(packed([1, 2]), 0)


@needs_native
@pytest.mark.parametrize("native", [True, False])
def test_unlock_refusals_are_the_same_in_c_and_python_and_change_nothing(native):
    idx, other = make_index(), make_index()
    if not native:
        idx.use_native(None)
    keys, toks = seq(1, 2, 3)
    for x in (idx, other):
        x.insert(keys, toks, engine=0, device_pages=np.arange(1, 4), host_pages=np.arange(1, 4))
    node = idx.match(keys, 0).last_node
    foreign = other.match(keys, 0).last_node
    idx.lock(node, Tier.HOST)
    before = snapshot(idx)
    cases = [((node, Tier.DEVICE, 0), IndexStateError),  # below zero: no device lock held
             ((foreign, Tier.HOST), IndexStateError),  # another index's node
             ((idx.root, Tier.HOST), IndexInputError),
             (("node", Tier.HOST), IndexInputError)]
    for args, err in cases:
        with pytest.raises(err):
            idx.unlock(*args)
        with pytest.raises(err):
            idx.unlock_held([args if len(args) == 3 else (*args, None)])
        assert snapshot(idx) == before
    idx.unlock_held([(node, Tier.HOST, None)])
    idx.evict(Tier.DEVICE, 3, 0)
    idx.evict(Tier.HOST, 3)  # the node goes with its last copy
    assert node.removed
    with pytest.raises(IndexStateError):
        idx.unlock(node, Tier.HOST)
    check_invariants(idx)
