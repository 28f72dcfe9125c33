"""Helpers for the radix index tests: sequences, an independent invariant check, snapshots."""

from __future__ import annotations

from collections import Counter

import numpy as np

from hicache.index.keys import page_keys
from hicache.index.node import DISK_LANE, HOST_LANE, Tier, TreeNode
from hicache.index.radix import RadixIndex

PS = 4
SALT = bytes(range(16))


class Clock:
    """A clock the test advances: every read is one tick later."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_index(policy=None) -> RadixIndex:
    return RadixIndex(PS, SALT, policy=policy, clock=Clock())


def seq(*page_ids: int) -> tuple[list[bytes], np.ndarray]:
    """Keys and tokens of a sequence whose page i holds PS copies of page_ids[i]."""
    tokens = np.repeat(np.asarray(page_ids, dtype=np.int32), PS)
    return page_keys(SALT, tokens, PS), tokens


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def lane_of(tier: Tier, engine: int | None) -> int:
    if tier is Tier.DEVICE:
        return engine
    return HOST_LANE if tier is Tier.HOST else DISK_LANE


def resident(node: TreeNode, lane: int) -> bool:
    if lane >= 0:
        return lane in node.device
    return node.host is not None if lane == HOST_LANE else node.on_disk


def path_to(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def all_nodes(idx: RadixIndex) -> list[TreeNode]:
    out, stack = [], list(idx.root.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def expected_locks(held: list[tuple[TreeNode, Tier, int | None]]) -> dict[int, tuple[list[int], Counter]]:
    """Per node id: lock refs and device refs per engine implied by the locks a test holds."""
    out: dict[int, tuple[list[int], Counter]] = {}
    for node, tier, engine in held:
        x = node
        while x.parent is not None:
            refs, dev = out.setdefault(id(x), ([0, 0, 0], Counter()))
            refs[tier] += 1
            if tier is Tier.DEVICE:
                dev[engine] += 1
            x = x.parent
    return out


def lane_locked(node: TreeNode, lane: int, locks: dict) -> bool:
    refs, dev = locks.get(id(node), ([0, 0, 0], Counter()))
    if lane >= 0:
        return dev[lane] > 0 or dev[None] > 0
    return refs[Tier.HOST if lane == HOST_LANE else Tier.DISK] > 0


def is_candidate(node: TreeNode, lane: int, locks: dict) -> bool:
    """Recomputed from scratch: resident, no child resident in the lane, unlocked in it,
    and removable if this is its only tier."""
    if not resident(node, lane) or any(resident(c, lane) for c in node.children.values()):
        return False
    if lane_locked(node, lane, locks):
        return False
    refs = locks.get(id(node), ([0, 0, 0], Counter()))[0]
    return not (len(node.lanes()) == 1 and any(refs))


def check_invariants(idx: RadixIndex, held: list[tuple[TreeNode, Tier, int | None]] = ()) -> None:
    """Recompute everything the index keeps incrementally and compare."""
    locks = expected_locks(list(held))
    res_pages: Counter = Counter()
    prot_pages: Counter = Counter()
    stack = [(c, SALT) for c in idx.root.children.values()]
    while stack:
        x, parent_key = stack.pop()
        n = x.n_pages
        assert n >= 1 and not x.removed
        assert x.parent.children[x.keys[0]] is x
        assert x.tokens.dtype == np.int32 and len(x.tokens) == n * PS
        if page_keys(SALT, x.tokens, PS, parent=parent_key) != x.keys:  # else keyed engines' named pages:
            named = [page_keys(SALT, x.tokens[i * PS:(i + 1) * PS], PS)[0] for i in range(n)]
            assert named == x.keys, "keys do not chain"  # each hashes (salt, its tokens) wherever it hangs
        for arr in [*x.device.values(), *([x.host] if x.host is not None else [])]:
            assert arr.dtype == np.int64 and arr.shape == (n,)
        refs, dev = locks.get(id(x), ([0, 0, 0], Counter()))
        assert x.lock_ref == refs, (x, refs)
        assert {k: v for k, v in x.device_locks.items() if v} == {k: v for k, v in dev.items() if v}
        # A node in no tier exists only while a lock keeps it.
        assert x.in_any_tier or any(refs), x
        child_lanes = Counter(lane for c in x.children.values() for lane in c.lanes())
        assert x.child_lanes == dict(child_lanes)
        for lane in x.lanes():
            res_pages[lane] += n
            if lane_locked(x, lane, locks):
                prot_pages[lane] += n
            if is_candidate(x, lane, locks):
                assert lane in x.queued, (x, lane)
                assert any(entry[2] is x for entry in idx._ledger.candidates.heaps[lane])
        stack.extend((c, x.keys[-1]) for c in x.children.values())
    engines = {lane for lane in res_pages if lane >= 0} | {lane for lane in idx._ledger.resident if lane >= 0}
    for e in engines:
        assert idx.num_pages(Tier.DEVICE, e) == res_pages[e]
        assert idx.protected_pages(Tier.DEVICE, e) == prot_pages[e]
        assert idx.evictable_pages(Tier.DEVICE, e) == res_pages[e] - prot_pages[e]
    for tier, lane in ((Tier.HOST, HOST_LANE), (Tier.DISK, DISK_LANE)):
        assert idx.num_pages(tier) == res_pages[lane]
        assert idx.protected_pages(tier) == prot_pages[lane]


def snapshot(idx: RadixIndex) -> tuple:
    """Everything observable about the tree, for 'nothing changed' assertions."""
    rows = []
    for x in all_nodes(idx):
        rows.append((
            tuple(k for p in path_to(x) for k in p.keys), x.tokens.tobytes(),
            tuple(sorted((e, a.tobytes()) for e, a in x.device.items())),
            None if x.host is None else x.host.tobytes(), x.on_disk, tuple(x.lock_ref),
            tuple(sorted(x.device_locks.items(), key=repr)), x.last_access, x.hit_count,
        ))
    counts = tuple((t, idx.num_pages(t), idx.protected_pages(t)) for t in Tier)
    return tuple(sorted(rows)), counts, len(idx._outbox)


def freed_by_tier(freed) -> dict:
    """{(tier, engine): (keys, slots list)} merged over a Freed list."""
    out: dict = {}
    for f in freed:
        keys, slots = out.setdefault((f.tier, f.engine), ([], []))
        keys.extend(f.keys)
        if f.slots is not None:
            slots.extend(f.slots.tolist())
        else:
            assert f.tier is Tier.DISK
    return out
