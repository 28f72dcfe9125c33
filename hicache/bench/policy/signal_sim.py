"""Structure signals as eviction priorities, simulated on a trace's block sequence.

Issue 29 asks whether what the radix index knows at no cost predicts reuse better
than recency: a block's depth in the prompt (head blocks are shared by more
requests than tail blocks) and a node's fan-out (how many distinct children it has
had while cached: a prefix many requests branched from is likely to be branched
from again). `SignalSim` is one pool of `capacity` blocks whose eviction priority is

    base + W * signal(block)

- base: the last touch (LRU) or hicache's frecency (hicache/index/policy.py);
- W: frecency's unit, the moving average of how long a never-hit block stayed
  between its last touch and its eviction, so a signal of 1 buys one typical
  lifetime of extra residence;
- signal: none, "depth" (1 / (1 + depth / HEAD_BLOCKS)), "relative depth"
  (1 - depth / request length, the head of each request high, its tail low) or
  "fan-out" (log2(1 + distinct children)).

A request's blocks are touched leaf first; only a leaf (a block with no cached child)
is evicted, as in a radix cache, since a signal can rank a child above its parent
and a prefix cache can use no block below a hole. Ties break by touch order.
Nothing here is in the daemon; `bench trace --signals` prints each signal's hit
rate next to LRU and OPT of the same capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from heapq import heappop, heappush

from hicache.bench.policy.policy_sim import BlockTrace, CachePolicy, simulate
from hicache.bench.report import row
from hicache.index.policy import frecency

HEAD_BLOCKS = 4  # depth (in blocks) at which the depth signal has halved
BASES = ("LRU", "frecency")
SIGNALS = ("none", "depth", "relative depth", "fan-out")


class SignalSim(CachePolicy):
    def __init__(self, capacity: int, base: str = "LRU", signal: str = "none", window: int = 64) -> None:
        if base not in BASES:
            raise ValueError(f"base must be one of {BASES}, got {base!r}")
        if signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
        super().__init__(capacity)
        self.base, self.signal = base, signal
        self.name = base if signal == "none" else f"{base} + {signal}"
        self._alpha = 1.0 / window
        self._lifetime = 0.0
        self._now = 0  # request number: the time unit of W
        self._seq = 0  # touch number: the tie-break
        self._hits: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._children: dict[int, set[int]] = {}  # distinct children seen while cached: the fan-out
        self._parent: dict[int, int | None] = {}
        self._cached_kids: dict[int, int] = {}
        self._prio: dict[int, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, int]] = []  # (priority, touch, block), lazy

    def __contains__(self, block: int) -> bool:
        return block in self._prio

    def cached(self) -> set[int]:
        return set(self._prio)

    def _signal(self, block: int, depth: int, length: int) -> float:
        if self.signal == "depth":
            return 1.0 / (1.0 + depth / HEAD_BLOCKS)
        if self.signal == "relative depth":
            return 1.0 - depth / length
        if self.signal == "fan-out":
            return math.log2(1 + len(self._children.get(block, ())))
        return 0.0

    def request(self, ids: Sequence[int], pos: int) -> None:
        self._now += 1
        if self.capacity <= 0:
            return
        for parent, child in zip(ids, ids[1:]):
            if parent in self._prio:
                self._children.setdefault(parent, set()).add(child)
        for depth in range(len(ids) - 1, -1, -1):
            b = ids[depth]
            if b in self._prio:
                self._hits[b] += 1
            else:
                self._make_room()
                self._insert(b, ids[depth - 1] if depth else None, ids[depth + 1] if depth + 1 < len(ids) else None)
            self._last[b] = self._now
            base = float(self._now) if self.base == "LRU" else frecency(float(self._now), self._hits[b], self._lifetime)
            self._seq += 1
            self._push(b, (base + self._lifetime * self._signal(b, depth, len(ids)), self._seq))

    def _push(self, b: int, prio: tuple[float, int]) -> None:
        self._prio[b] = prio
        heappush(self._heap, (*prio, b))

    def _insert(self, b: int, parent: int | None, child: int | None) -> None:
        self._hits[b] = 0
        self._parent[b] = parent
        if parent in self._prio:
            self._cached_kids[parent] += 1
        held_child = child is not None and child in self._prio
        self._cached_kids[b] = int(held_child)
        if child is not None:
            self._children[b] = {child}

    def _make_room(self) -> None:
        while len(self._prio) >= self.capacity:
            prio, seq, b = heappop(self._heap)
            if self._prio.get(b) != (prio, seq) or self._cached_kids[b]:
                continue  # stale (touched since), or not a leaf: pushed again when it becomes one
            del self._prio[b]
            del self._cached_kids[b]
            self._children.pop(b, None)
            last = self._last.pop(b)
            if not self._hits.pop(b):
                self._lifetime += (self._now - last - self._lifetime) * self._alpha
            parent = self._parent.pop(b)
            if parent in self._prio:
                self._cached_kids[parent] -= 1
                if not self._cached_kids[parent]:
                    self._push(parent, self._prio[parent])


def signal_rows(trace: BlockTrace, label: str, capacity: int, opt: float, lru: float) -> list[dict]:
    """Each base with each signal: hit rate against the same run's LRU (`policy_sim`'s,
    same capacity), its share of the LRU-to-OPT gap, and its change over the base alone."""
    rows = [row(f"signals @ {label}: capacity", capacity, "blocks")]
    for base in BASES:
        alone = None
        for signal in SIGNALS:
            sim = SignalSim(capacity, base, signal)
            rate = simulate(trace, sim).hit_rate
            if alone is None:
                alone = rate
            gap = f"gap closed {(rate - lru) / (opt - lru):+.3f}" if opt > lru else ""
            rows.append(row(f"signals @ {label}: {sim.name}: hit rate", rate, "fraction", baseline=lru,
                            baseline_name="LRU", opt=opt, change_over_base=rate - alone, note=gap))
    return rows
