"""Randomized operations against a brute-force model.

The model keeps, per page key (a key names its whole prefix), which engines hold
it on device (with the page id), its host slot and its disk flag. Because the
index only ever moves residency through its return values (duplicates, cleared
pages, Freed lists), applying those to the model must reproduce the tree
exactly: nothing leaks, nothing appears. Invariants are recomputed from scratch
after every operation (radix_util.check_invariants).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from hicache.index.node import DISK_LANE, HOST_LANE, Tier
from hicache.index.policy import LfuPolicy, LruPolicy
from hicache.index.radix import IndexStateError
from radix_util import (
    all_nodes, check_invariants, expected_locks, is_candidate, lane_locked, lane_of,
    make_index, path_to, seq,
)

DEV, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
ENGINES = (0, 1)


@dataclass
class Page:
    dev: dict[int, int] = field(default_factory=dict)
    host: int | None = None
    disk: bool = False

    def empty(self) -> bool:
        return not self.dev and self.host is None and not self.disk


class Model:
    def __init__(self) -> None:
        self.pages: dict[bytes, Page] = {}

    def page(self, key: bytes) -> Page:
        return self.pages.setdefault(key, Page())

    def prune(self) -> None:
        self.pages = {k: p for k, p in self.pages.items() if not p.empty()}

    def apply_freed(self, freed) -> None:
        for f in freed:
            if f.tier is DEV:
                for k, s in zip(f.keys, f.slots.tolist(), strict=True):
                    assert self.pages[k].dev.pop(f.engine) == s
            elif f.tier is HOST:
                for k, s in zip(f.keys, f.slots.tolist(), strict=True):
                    assert self.pages[k].host == s
                    self.pages[k].host = None
            else:
                assert f.slots is None
                for k in f.keys:
                    assert self.pages[k].disk
                    self.pages[k].disk = False
        self.prune()

    def match(self, keys, engine):
        dev, host, disk = [], [], []
        stage = 0 if engine is not None else 1
        for k in keys:
            p = self.pages.get(k)
            if p is None:
                break
            if stage == 0 and engine in p.dev:
                dev.append(p.dev[engine])
            elif stage <= 1 and p.host is not None:
                stage = 1
                host.append(p.host)
            elif p.disk or p.host is not None:
                stage = 2
                disk.append(k)
            else:
                break
        return dev, host, disk


def tree_residency(idx):
    out = {}
    for x in all_nodes(idx):
        if not x.in_any_tier:
            continue  # kept only by a lock; holds nothing
        for i, k in enumerate(x.keys):
            out[k] = ({e: int(a[i]) for e, a in x.device.items()},
                      None if x.host is None else int(x.host[i]), x.on_disk)
    return out


def path_keys(node):
    return [k for p in path_to(node) for k in p.keys]


class Run:
    def __init__(self, seed: int, policy) -> None:
        self.rng = random.Random(seed)
        self.idx = make_index(policy)
        self.model = Model()
        self.held: list = []
        self.pool: list[tuple[int, ...]] = []
        self.ids = itertools.count(1)

    def fresh(self, n: int) -> np.ndarray:
        return np.array([next(self.ids) for _ in range(n)], dtype=np.int64)

    def sequence(self) -> tuple[int, ...]:
        rng = self.rng
        base = rng.choice(self.pool) if self.pool and rng.random() < 0.8 else ()
        pages = base[:rng.randint(0, len(base))] + tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 4)))
        return pages or (rng.randint(0, 3),)

    # ---------------------------------------------------------------- operations

    def op_insert(self) -> None:
        rng, idx, model = self.rng, self.idx, self.model
        pages = self.sequence()
        self.pool.append(pages)
        keys, tokens = seq(*pages)
        n = len(keys)
        engine = rng.choice(ENGINES)
        dev = self.fresh(n) if rng.random() < 0.6 else None
        host = self.fresh(n) if rng.random() < 0.5 else None
        disk = rng.random() < 0.3
        if dev is None and host is None and not disk:
            disk = True
        in_tree = {k for x in all_nodes(idx) for k in x.keys}
        present = next((i for i, k in enumerate(keys) if k not in in_tree), n)
        r = idx.insert(keys, tokens, engine=engine, device_pages=dev, host_pages=host, on_disk=disk)
        assert r.present_pages == present
        assert path_keys(r.nodes[-1]) == keys
        dup_dev, dup_host = [], []
        for i, k in enumerate(keys):
            p = model.page(k)
            if dev is not None:
                if engine in p.dev:
                    dup_dev.append(int(dev[i]))
                else:
                    p.dev[engine] = int(dev[i])
            if host is not None:
                if p.host is not None:
                    dup_host.append(int(host[i]))
                else:
                    p.host = int(host[i])
            p.disk |= disk
        assert r.dup_device_pages.tolist() == dup_dev
        assert r.dup_host_pages.tolist() == dup_host

    def op_match(self) -> None:
        rng, idx = self.rng, self.idx
        pages = self.sequence() if rng.random() < 0.3 or not self.pool else rng.choice(self.pool)
        keys, _ = seq(*pages)
        engine = rng.choice((*ENGINES, None))
        m = idx.match(keys, engine=engine)
        dev, host, disk = self.model.match(keys, engine)
        assert m.device_pages.tolist() == dev
        assert m.host_pages.tolist() == host
        assert m.disk_keys == disk
        if m.nodes:
            assert path_keys(m.last_node) == keys[:m.num_pages]
        else:
            assert m.last_node is idx.root
        if rng.random() < 0.5:
            for nodes, tier, eng in ((m.device_nodes, DEV, engine), (m.host_nodes, HOST, None),
                                     (m.disk_nodes, DISK, None)):
                if nodes:
                    if tier is DEV and rng.random() < 0.2:
                        eng = None  # protect every engine's copy
                    idx.lock(nodes[-1], tier, engine=eng)
                    self.held.append((nodes[-1], tier, eng))

    def op_unlock(self) -> None:
        if self.held:
            node, tier, engine = self.held.pop(self.rng.randrange(len(self.held)))
            self.idx.unlock(node, tier, engine=engine)

    def op_evict(self) -> None:
        rng, idx = self.rng, self.idx
        tier = rng.choice(list(Tier))
        engine = rng.choice(ENGINES) if tier is DEV else None
        lane = lane_of(tier, engine)
        num = rng.randint(0, 6)
        locks = expected_locks(self.held)
        nodes = all_nodes(idx)
        cands = [x for x in nodes if is_candidate(x, lane, locks)]
        first = min(cands, key=lambda x: idx.policy.get_priority(x), default=None)
        first_keys = None if first is None else list(first.keys)
        lane_locked_keys = {k for x in nodes if lane_locked(x, lane, locks) for k in x.keys}
        any_locked_keys = {k for x in nodes if any(x.lock_ref) for k in x.keys}
        freed = idx.evict(tier, num, engine=engine)
        got = 0
        for f in freed:
            f_lane = lane_of(f.tier, f.engine)
            for k in f.keys:
                assert k not in (lane_locked_keys if f_lane == lane else any_locked_keys)
            if f_lane == lane:
                got += len(f.keys)
        if num and first_keys is not None:
            assert set(first_keys) <= {k for f in freed if lane_of(f.tier, f.engine) == lane
                                       for k in f.keys}, "lowest priority candidate not taken first"
        self.model.apply_freed(freed)
        if got < num:  # it took all it could
            locks = expected_locks(self.held)
            assert not [x for x in all_nodes(idx) if is_candidate(x, lane, locks)]

    def op_set(self) -> None:
        rng, idx, model = self.rng, self.idx, self.model
        nodes = all_nodes(idx)
        if not nodes:
            return
        node = rng.choice(nodes)
        keys = path_keys(node)
        count = rng.randint(0, len(keys))
        suffix = keys[len(keys) - count:]
        which = rng.choice(("device", "host", "disk"))
        if which == "disk":
            flag = rng.random() < 0.6
            locks = expected_locks(self.held)
            blocked = not flag and any(
                model.pages.get(k, Page()).disk and lane_locked(x, DISK_LANE, locks)
                for x in path_to(node) for k in x.keys if k in suffix)
            if blocked:
                with pytest.raises(IndexStateError):
                    idx.set_disk(node, flag, num_pages=count)
                return
            idx.set_disk(node, flag, num_pages=count)
            for k in suffix:
                if flag:
                    model.page(k).disk = True
                elif k in model.pages:
                    model.pages[k].disk = False
            model.prune()
            return
        pages = self.fresh(count)
        engine = rng.choice(ENGINES)
        if which == "device":
            dups = idx.set_device(node, engine, pages)
        else:
            dups = idx.set_host(node, pages)
        expect = []
        for k, pid in zip(suffix, pages.tolist(), strict=True):
            p = model.page(k)
            if which == "device":
                if engine in p.dev:
                    expect.append(pid)
                else:
                    p.dev[engine] = pid
            elif p.host is not None:
                expect.append(pid)
            else:
                p.host = pid
        assert dups.tolist() == expect

    def op_clear(self) -> None:
        rng, idx, model = self.rng, self.idx, self.model
        nodes = all_nodes(idx)
        if not nodes:
            return
        node = rng.choice(nodes)
        locks = expected_locks(self.held)
        if rng.random() < 0.5:
            engine = rng.choice(ENGINES)
            if engine in node.device and lane_locked(node, engine, locks):
                with pytest.raises(IndexStateError):
                    idx.clear_device(node, engine)
                return
            expect = [model.pages[k].dev.pop(engine) for k in node.keys] if engine in node.device else []
            assert idx.clear_device(node, engine).tolist() == expect
        else:
            if node.host is not None and lane_locked(node, HOST_LANE, locks):
                with pytest.raises(IndexStateError):
                    idx.clear_host(node)
                return
            had = node.host is not None
            out = idx.clear_host(node)
            if had:
                assert out.tolist() == [model.pages[k].host for k in node.keys]
                for k in node.keys:
                    model.pages[k].host = None
            else:
                assert out is None
        model.prune()

    def op_remove_engine(self) -> None:
        engine = self.rng.choice(ENGINES)
        self.model.apply_freed(self.idx.remove_engine(engine))
        self.held = [h for h in self.held if not (h[1] is DEV and h[2] == engine)]

    def op_flush(self) -> None:
        self.model.apply_freed(self.idx.flush(self.rng.choice(list(Tier))))

    # ---------------------------------------------------------------- driver

    def step(self) -> None:
        ops = [(self.op_insert, 30), (self.op_match, 25), (self.op_unlock, 12), (self.op_evict, 15),
               (self.op_set, 8), (self.op_clear, 6), (self.op_remove_engine, 1), (self.op_flush, 1)]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        op()
        self.model.apply_freed(self.idx.take_freed())
        self.verify()

    def verify(self) -> None:
        want = {k: (p.dev, p.host, p.disk) for k, p in self.model.pages.items()}
        assert tree_residency(self.idx) == want
        check_invariants(self.idx, self.held)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_agree_with_the_model(seed):
    run = Run(seed, LfuPolicy() if seed % 3 == 2 else LruPolicy())
    for _ in range(300):
        run.step()
    # Release everything, then every tier can be emptied completely.
    while run.held:
        run.op_unlock()
    run.model.apply_freed(run.idx.take_freed())
    for engine in ENGINES:
        run.model.apply_freed(run.idx.evict(DEV, 10**9, engine=engine))
    run.model.apply_freed(run.idx.evict(HOST, 10**9))
    run.model.apply_freed(run.idx.evict(DISK, 10**9))
    run.verify()
    assert run.model.pages == {} and all_nodes(run.idx) == []
