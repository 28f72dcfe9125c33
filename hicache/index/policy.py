"""What may be evicted, and in which order.

- EvictionPolicy: a one-method strategy, `get_priority(node)`; lowest goes first.
- CandidateHeaps: per lane, the candidates ordered by that priority, kept lazily.
- ResidencyLedger: per lane, resident and locked pages of one tree, and the
  edits (add or drop residency, lock walks, subtree removal) that keep those
  counts and the candidate heaps right. RadixIndex owns the tree shape and
  makes every residency or lock change through its ledger.

Contract for policies: while a node waits as a candidate its priority may only
grow (a touch raises it, nothing lowers it). That lets the heaps stay
incremental without a push per access: an entry is re-checked when it reaches
the top and pushed back if its priority has grown. LRU and LFU satisfy it.
Priorities are compared with `<`, also across indexes (namespaces sharing one
budget), so those indexes should share one policy.

Hint priorities come first. A heap orders candidates by the *eviction key*
(hint priority, policy priority): an application's priority on a prefix
(hicache/index/priorities.py, by page key in `hints`) sends lower-priority
pages out first and leaves equals to the policy, as SGLang's priority eviction
does. A hint priority that drops (expiry, a lower hint) breaks the only-grow
contract, so its owner then calls `refresh()`, which re-keys the whole heap;
it does as well when an index gets its first hint or loses its last: without
any, entries hold the policy's priority alone, with no tuple per push.

Policies (`make_policy(name)`, the daemon's `eviction_policy`):
- `lru`: least recently used first; the reference every bench compares against.
- `lfu`: fewest hits first.
- `frecency` (default): recency plus a bonus for reuse, priority =
  last_access + W * log2(1 + hit_count), W = the lifetime of a page never hit
  (how long such a page stays between its last access and its eviction, a
  moving average over the tier's evictions). A page hit once is kept as if it
  were one such lifetime younger, hit three times two lifetimes: shared system
  prompts and documents outlive one-shot scans and never-continued chats, while
  W follows the capacity and the request rate without a tuning knob. Chosen on
  the simulated traces (hicache/bench/policy/policy_sim.py, `FrecencySim`): on the
  Mooncake trace it matches or beats the best of LRU, SLRU, S3-FIFO, ARC and
  LFU-aging at 10-15% capacity and is within 0.003 of it at 5-60%; on generated
  workloads the specialists lead it by up to 0.036. See the README's trace bench.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, TypeAlias

import numpy as np

from hicache.index.node import DISK_LANE, HOST_LANE, NO_ENTRIES, FreedCollector, Tier, TreeNode

Priority: TypeAlias = float | tuple[int, float]
EvictionKey: TypeAlias = tuple[int, Priority]  # (hint priority, the policy's); lowest leaves first


class EvictionPolicy(ABC):
    name = "?"

    @abstractmethod
    def get_priority(self, node: TreeNode) -> Priority:
        """Lower is evicted first."""

    def on_evict(self, node: TreeNode, lane: int, now: float) -> None:
        """`node` left `lane` by eviction (not by flush or removal) at `now`."""


class LruPolicy(EvictionPolicy):
    """Least recently matched or inserted first."""

    name = "lru"

    def get_priority(self, node: TreeNode) -> float:
        return node.last_access


class LfuPolicy(EvictionPolicy):
    """Fewest matches first, least recent among equals."""

    name = "lfu"

    def get_priority(self, node: TreeNode) -> tuple[int, float]:
        return (node.hit_count, node.last_access)


class FrecencyPolicy(EvictionPolicy):
    """last_access + W * log2(1 + hit_count), W = `weight` lifetimes of a never-hit page.

    The lifetime is an exponential moving average (over `window` evictions) of
    now - last_access of the never-hit pages evicted from the host and disk lanes,
    per lane; W uses the longest (the last tier's, where an eviction loses the
    page). A node's priority is computed when it was touched and kept in
    `node.policy_memo`, so it does not move while the node waits in a heap; the
    next touch raises last_access and the hit count, and so the priority (W moves
    slowly: at most by 1/window of a lifetime per eviction)."""

    name = "frecency"

    def __init__(self, weight: float = 1.0, window: int = 64) -> None:
        if not weight >= 0 or window < 1:
            raise ValueError("weight must be >= 0 and window >= 1")
        self.weight = weight
        self._alpha = 1.0 / window
        self.lifetimes: dict[int, float] = {}  # lane -> lifetime of a never-hit page

    @property
    def bonus_unit(self) -> float:
        return self.weight * max(self.lifetimes.values(), default=0.0)

    def get_priority(self, node: TreeNode) -> float:
        la, hits = node.last_access, node.hit_count
        memo = node.policy_memo
        if memo is not None and memo[0] == la and memo[1] == hits:
            return memo[2]
        prio = frecency(la, hits, self.bonus_unit)
        node.policy_memo = (la, hits, prio)
        return prio

    def on_evict(self, node: TreeNode, lane: int, now: float) -> None:
        if node.hit_count or lane not in (HOST_LANE, DISK_LANE):
            return
        age = max(0.0, now - node.last_access)
        cur = self.lifetimes.get(lane)
        self.lifetimes[lane] = age if cur is None else cur + (age - cur) * self._alpha


def frecency(last_access: float, hits: int, unit: float) -> float:
    """The frecency priority (also simulated by hicache/bench/policy/policy_sim.py)."""
    return last_access + unit * math.log2(1 + hits) if hits else last_access


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, LfuPolicy, FrecencyPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}") from None


class CandidateHeaps:
    """One min-heap of eviction candidates per lane, with lazy deletion.

    The owner says what a candidate is (`is_candidate(node, lane)`) and calls
    push() whenever a node may have become one. Each (node, lane) has at most one
    entry, recorded in `node.queued`; an entry whose node stopped being a candidate
    is dropped when it reaches the top, or by compaction once a heap outgrows
    `2 * bound + 64` entries (bound: the lane's resident pages, at least its number
    of candidates): amortized O(log n) per push, and nothing re-heapifies every
    leaf per call.
    """

    __slots__ = ("policy", "is_candidate", "hints", "heaps", "_seq", "_keyed")

    def __init__(self, policy: EvictionPolicy, is_candidate: Callable[[TreeNode, int], bool],
                 hints: dict[bytes, int] | None = None) -> None:
        self.policy = policy
        self.is_candidate = is_candidate
        # page key -> hint priority (a node's pages share theirs: hints cover whole nodes)
        self.hints: dict[bytes, int] = {} if hints is None else hints
        self.heaps: dict[int, list[tuple[EvictionKey | Priority, int, TreeNode]]] = {}
        self._seq = itertools.count()  # ties: first queued goes first; nodes are never compared
        # Whether entries carry the full eviction key. Without any hint they hold the policy's
        # priority alone (no tuple per push on the hot path); refresh() switches, re-keying all.
        self._keyed = False

    def key(self, node: TreeNode) -> EvictionKey | Priority:
        """What the heap orders by: the eviction key, or the policy's priority alone while
        the index has no hint (see `full_key`)."""
        if self._keyed:
            return (self.hints.get(node.keys[0], 0), self.policy.get_priority(node))
        return self.policy.get_priority(node)

    def full_key(self, key: EvictionKey | Priority) -> EvictionKey:
        """A heap key as the eviction key: comparable across indexes whatever their mode."""
        return key if self._keyed else (0, key)  # type: ignore[return-value]

    def push(self, node: TreeNode, lane: int, bound: int) -> None:
        heap = self.heaps.get(lane)
        if heap is None:
            heap = self.heaps[lane] = []
        key = self.key(node) if self._keyed else self.policy.get_priority(node)
        heappush(heap, (key, next(self._seq), node))
        if lane not in node.queued:
            node.queued += (lane,)
        if len(heap) > 2 * bound + 64:
            self._compact(lane)

    def top(self, lane: int, pop: bool) -> tuple[EvictionKey | Priority, TreeNode] | None:
        """The lowest-priority candidate of the lane (taken out of the heap if `pop`)."""
        heap = self.heaps.get(lane)
        if not heap:
            return None
        priority_of = self.key if self._keyed else self.policy.get_priority
        while heap:
            prio, _, node = heap[0]
            if not self.is_candidate(node, lane):
                heappop(heap)
                unqueue(node, lane)
                continue
            cur = priority_of(node)
            if cur != prio:  # touched since it was queued: priorities only grow
                heapreplace(heap, (cur, next(self._seq), node))
                continue
            if pop:
                heappop(heap)
                unqueue(node, lane)
            return prio, node
        return None

    def drop_lane(self, lane: int) -> None:
        """Forget a lane (its engine is gone); the caller clears `queued` on the nodes."""
        self.heaps.pop(lane, None)

    def refresh(self) -> None:
        """Re-key every entry (a hint priority dropped, or the first one came or the last
        went): O(entries), once per change batch."""
        self._keyed = bool(self.hints)
        for lane in self.heaps:
            self._compact(lane, rekey=True)

    def _compact(self, lane: int, rekey: bool = False) -> None:
        keep = []
        for entry in self.heaps[lane]:
            if self.is_candidate(entry[2], lane):
                keep.append((self.key(entry[2]), entry[1], entry[2]) if rekey else entry)
            else:
                unqueue(entry[2], lane)
        heapify(keep)
        self.heaps[lane] = keep


class ResidencyLedger:
    """Resident and protected (locked) pages per lane of one tree, and its candidates.

    A candidate of a lane is a node resident in it, with no child resident in it,
    not locked in it, and -- if this is its only tier, so that evicting it removes
    it -- holding no lock at all (locks count on ancestors, so that covers its
    subtree). The ledger re-queues a node whenever one of these may have turned true.
    """

    __slots__ = ("root", "resident", "protected", "candidates", "removed_states", "_lock_native", "_unlock_native")

    def __init__(self, root: TreeNode, policy: EvictionPolicy, hints: dict[bytes, int] | None = None) -> None:
        self.root = root
        self.resident: dict[int, int] = {HOST_LANE: 0, DISK_LANE: 0}
        self.protected: dict[int, int] = {HOST_LANE: 0, DISK_LANE: 0}
        self.candidates = CandidateHeaps(policy, self.is_candidate, hints)
        self.removed_states: list[object] = []  # checkpoints of removed nodes, for their owner to free
        self.use_native(None)

    def use_native(self, mod: Any) -> None:
        """Take and drop locks with the C loops of hicache/index/native_index.py (None: in
        Python); both do the same, step for step."""
        self._lock_native = None if mod is None else mod.lock_path
        self._unlock_native = None if mod is None else mod.unlock_path

    def is_candidate(self, node: TreeNode, lane: int) -> bool:
        if node.removed or not node.resident_in(lane):
            return False
        if node.child_lanes.get(lane) or node.lane_locked(lane):
            return False
        only = len(node.device) + (node.host is not None) + node.on_disk == 1
        return not (only and any(node.lock_ref))

    def maybe_queue(self, node: TreeNode, lane: int) -> None:
        if lane not in node.queued and self.is_candidate(node, lane):
            self.candidates.push(node, lane, self.resident.get(lane, 0))

    def requeue(self, node: TreeNode, lane: int) -> None:
        """Put back a candidate taken out with top(pop=True) but not evicted."""
        self.candidates.push(node, lane, self.resident.get(lane, 0))

    # ------------------------------------------------------------------ residency

    def add_lane(self, node: TreeNode, lane: int, pages: np.ndarray | None) -> None:
        if lane >= 0:
            dev = node.device
            if dev is NO_ENTRIES:
                dev = node.device = {}
            dev[lane] = pages
        elif lane == HOST_LANE:
            node.host = pages
        else:
            node.on_disk = True
        n = len(node.keys)
        self.resident[lane] = self.resident.get(lane, 0) + n
        if node.lane_locked(lane):
            self.protected[lane] = self.protected.get(lane, 0) + n
        parent = node.parent
        if parent is not self.root:  # the root is never a candidate: no counts there
            count_child(parent, lane)
        if any(node.lock_ref):  # a second tier can make its other lanes evictable
            for other in node.lanes():
                self.maybe_queue(node, other)
        else:
            self.maybe_queue(node, lane)

    def drop_lane(self, node: TreeNode, lane: int) -> np.ndarray | None:
        if lane >= 0:
            pages = node.device.pop(lane)
            if not node.device:
                node.device = NO_ENTRIES
        elif lane == HOST_LANE:
            pages, node.host = node.host, None
        else:
            pages, node.on_disk = None, False
        n = len(node.keys)
        self.resident[lane] -= n
        if node.lane_locked(lane):
            self.protected[lane] -= n
        parent = node.parent
        if parent is not self.root:
            cl = parent.child_lanes
            c = cl[lane] - 1
            if c:
                cl[lane] = c
            else:
                del cl[lane]
                if not cl:
                    parent.child_lanes = NO_ENTRIES
                self.maybe_queue(parent, lane)
        return pages

    def reap(self, node: TreeNode, acc: FreedCollector) -> None:
        """Remove `node` with its subtree if it is in no tier and holds no lock."""
        if not node.removed and not node.in_any_tier and not any(node.lock_ref):
            self.remove_subtree(node, acc)

    def remove_subtree(self, node: TreeNode, acc: FreedCollector) -> None:
        """Remove `node` (in no tier, unlocked, so nothing below is locked either)
        with its subtree, reporting all residency below it."""
        del node.parent.children[node.keys[0]]  # in no tier: the parent's child_lanes never counted it
        res = self.resident
        stack = [node]
        while stack:
            x = stack.pop()
            n = len(x.keys)
            for lane, pages in x.device.items():
                res[lane] -= n
                acc.add(lane, x.keys, pages)
            if x.host is not None:
                res[HOST_LANE] -= n
                acc.add(HOST_LANE, x.keys, x.host)
            if x.on_disk:
                res[DISK_LANE] -= n
                acc.add(DISK_LANE, x.keys, None)
            stack.extend(x.children.values())
            if x.state is not None:
                self.removed_states.append(x.state)
                x.state = None
            # Stale holders must not see freed slot ids.
            x.removed = True
            x.parent = None
            x.children = {}
            x.device = NO_ENTRIES
            x.host = None
            x.on_disk = False
            x.child_lanes = NO_ENTRIES

    def forget_engine(self, nodes: list[TreeNode], engine: int, acc: FreedCollector) -> None:
        """Drop the engine's residency and device locks from `nodes` (every node of the
        tree), reporting its pages; the caller then reaps nodes left in no tier."""
        for x in nodes:
            if engine in x.device_locks:
                x.lock_ref[Tier.DEVICE] -= _pop(x, "device_locks", engine)
            if engine in x.child_lanes:
                _pop(x, "child_lanes", engine)
            unqueue(x, engine)
            if engine in x.device:
                acc.add(engine, x.keys, _pop(x, "device", engine))
        self.resident.pop(engine, None)
        self.protected.pop(engine, None)
        self.candidates.drop_lane(engine)

    # ------------------------------------------------------------------ locks

    def lock_path(self, path: list[TreeNode], tier: Tier, engine: int | None) -> None:
        """Add a ref on every node of `path` (a node and its ancestors)."""
        if self._lock_native is not None:
            self._lock_native(path, tier, engine, self.protected)
            return
        prot = self.protected
        if tier is Tier.DEVICE:
            for x in path:
                x.lock_ref[Tier.DEVICE] += 1
                dl = x.device_locks
                if dl is NO_ENTRIES:
                    dl = x.device_locks = {}
                c = dl.get(engine, 0) + 1
                dl[engine] = c
                if c == 1 and x.device:
                    n = len(x.keys)
                    for e in _engines_flipped(x, engine):
                        prot[e] = prot.get(e, 0) + n
            return
        lane = HOST_LANE if tier is Tier.HOST else DISK_LANE
        for x in path:
            r = x.lock_ref
            r[tier] += 1
            if r[tier] == 1 and x.resident_in(lane):
                prot[lane] += len(x.keys)

    def unlock_path(self, path: list[TreeNode], tier: Tier, engine: int | None) -> TreeNode | None:
        """Drop a ref on every node of `path` (the caller checked none goes below zero).
        Returns the highest node left in no tier and without locks: the caller removes it."""
        if self._unlock_native is not None:
            return self._unlock_native(path, tier, engine, self.protected, self.maybe_queue)
        prot = self.protected
        lane = HOST_LANE if tier is Tier.HOST else DISK_LANE
        doomed: TreeNode | None = None
        maybe_queue = self.maybe_queue
        for x in path:  # every release runs this: membership in `queued` tested before calls
            r = x.lock_ref
            if tier is Tier.DEVICE:
                r[Tier.DEVICE] -= 1
                dl = x.device_locks
                c = dl[engine] - 1
                if c:
                    dl[engine] = c
                elif x.device:
                    del dl[engine]
                    n = len(x.keys)
                    for e in _engines_flipped(x, engine):
                        prot[e] -= n
                        if e not in x.queued:
                            maybe_queue(x, e)
                else:
                    del dl[engine]
                if not dl:
                    x.device_locks = NO_ENTRIES
            else:
                r[tier] -= 1
                if r[tier] == 0 and x.resident_in(lane):
                    prot[lane] -= len(x.keys)
                    maybe_queue(x, lane)
            if not (r[0] or r[1] or r[2]):
                queued = x.queued
                if x.device or x.host is not None or x.on_disk:
                    for other in x.lanes():  # emptying it is allowed now: it is removable
                        if other not in queued:
                            maybe_queue(x, other)
                else:
                    doomed = x  # walking up: the last one found is the highest
        return doomed


def unqueue(node: TreeNode, lane: int) -> None:
    """The lane's heap entry of `node` is gone (node.queued is a tuple: one or two lanes)."""
    q = node.queued
    if lane in q:
        node.queued = tuple(x for x in q if x != lane)


def count_child(parent: TreeNode, lane: int) -> None:
    """One more child of `parent` resident in `lane` (its first makes it a dict)."""
    cl = parent.child_lanes
    if cl is NO_ENTRIES:
        cl = parent.child_lanes = {}
    cl[lane] = cl.get(lane, 0) + 1


def _pop(x: TreeNode, name: str, key: object) -> object:
    """Remove `key` from one of x's maps (it holds it), the shared empty map once it empties."""
    d = getattr(x, name)
    value = d.pop(key)
    if not d:
        setattr(x, name, NO_ENTRIES)
    return value


def _engines_flipped(x: TreeNode, key: int | None) -> list[int]:
    """Engines whose copy on `x` changes protection when the device-lock count of
    `key` (an engine, or None for all) moves between 0 and 1."""
    dl = x.device_locks
    if key is None:
        return [e for e in x.device if not dl.get(e)]
    return [key] if key in x.device and not dl.get(None) else []
