"""Cache policies simulated on a trace's block sequence: the bounds hicache is measured against.

A trace is a list of requests, each the ids of its full blocks in prompt order;
equal ids are equal prefixes (the id names the block *and* everything before
it), so the block before an id in a request is its parent. A request's hit is
the longest run of leading blocks that are all cached (a prefix cache can use
nothing after the first miss); then every block of the request is touched or
offered for admission. Capacities are in blocks.

- `infinite`: every block ever seen stays cached (the bound any cache meets).
- `OptPolicy`: Belady's offline optimum with bypass: evict the block needed
  furthest in the future, or do not admit the new one if it is needed later
  than all cached. Next uses are flat positions in the block sequence, so a
  parent's next use always precedes its child's: descendants go before
  ancestors without a special rule (ties among never-again blocks: deepest first).
- `LruPolicy`, `SlruPolicy`, `S3FifoPolicy`, `ArcPolicy`, `LfuAgingPolicy`: the
  online comparison set; `FrecencySim`: hicache's default eviction policy.
  They touch a request's blocks leaf first, so a parent is always more recent
  than its children, as in a radix cache.

Every policy is deterministic: the same trace and capacity give the same hits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

from hicache.index.policy import frecency

INF = 1 << 62


@dataclass(frozen=True, slots=True)
class BlockTrace:
    requests: tuple[tuple[int, ...], ...]  # full-block ids per request, prompt order
    prompt_tokens: int  # denominator of the hit rates (partial blocks count as misses)
    block_tokens: int

    @property
    def num_accesses(self) -> int:
        return sum(len(r) for r in self.requests)

    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r})


def block_trace(requests: Iterable[dict], block_tokens: int) -> BlockTrace:
    """From Mooncake-format records (`input_length`, `hash_ids`)."""
    reqs = []
    prompt = 0
    for r in requests:
        full = r["input_length"] // block_tokens
        reqs.append(tuple(r["hash_ids"][:full]))
        prompt += r["input_length"]
    return BlockTrace(tuple(reqs), prompt, block_tokens)


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    capacity_blocks: int
    hit_blocks: int
    total_blocks: int
    hit_rate: float  # hit tokens / prompt tokens


class CachePolicy(ABC):
    """A block cache of `capacity` blocks. `request` sees the request's ids and the
    flat position of its first block (the offline policy needs it)."""

    name = "?"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    @abstractmethod
    def cached(self) -> set[int]: ...

    def request(self, ids: Sequence[int], pos: int) -> None:
        for b in reversed(ids):
            if b in self:
                self.hit(b)
            else:
                self.admit(b)

    def hit(self, block: int) -> None:  # pragma: no cover - overridden by the online policies
        raise NotImplementedError

    def admit(self, block: int) -> None:  # pragma: no cover
        raise NotImplementedError


class InfinitePolicy(CachePolicy):
    name = "infinite"

    def __init__(self, capacity: int = INF) -> None:
        super().__init__(INF)
        self._seen: set[int] = set()

    def __contains__(self, block: int) -> bool:
        return block in self._seen

    def cached(self) -> set[int]:
        return set(self._seen)

    def request(self, ids: Sequence[int], pos: int) -> None:
        self._seen.update(ids)


class OptPolicy(CachePolicy):
    """Belady with bypass; `next_use[i]`: flat position of the next access of the block at i."""

    name = "OPT"

    def __init__(self, capacity: int, trace: BlockTrace) -> None:
        super().__init__(capacity)
        self._next_use = next_uses(trace)
        self._cache: dict[int, int] = {}  # block -> its next use
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazy

    def __contains__(self, block: int) -> bool:
        return block in self._cache

    def cached(self) -> set[int]:
        return set(self._cache)

    def _furthest(self) -> tuple[int, int]:
        heap, cache = self._heap, self._cache
        while True:
            nu, _, b = heap[0]
            if cache.get(b) == -nu:
                return -nu, b
            heappop(heap)

    def request(self, ids: Sequence[int], pos: int) -> None:
        cache, heap = self._cache, self._heap
        for depth, b in enumerate(ids):
            nu = self._next_use[pos + depth]
            if b in cache:
                cache[b] = nu
                heappush(heap, (-nu, -depth, b))
                continue
            if nu == INF or self.capacity <= 0:
                continue  # never needed again: admitting it cannot help
            if len(cache) >= self.capacity:
                far, victim = self._furthest()
                if far <= nu:
                    continue  # bypass: every cached block is needed sooner
                heappop(heap)
                del cache[victim]
            cache[b] = nu
            heappush(heap, (-nu, -depth, b))


def next_uses(trace: BlockTrace) -> list[int]:
    flat = [b for r in trace.requests for b in r]
    out = [INF] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        b = flat[i]
        out[i] = last.get(b, INF)
        last[b] = i
    return out


class LruPolicy(CachePolicy):
    name = "LRU"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._od

    def cached(self) -> set[int]:
        return set(self._od)

    def hit(self, block: int) -> None:
        self._od.move_to_end(block)

    def admit(self, block: int) -> None:
        if self.capacity <= 0:
            return
        if len(self._od) >= self.capacity:
            self._od.popitem(last=False)
        self._od[block] = None


class SlruPolicy(CachePolicy):
    """Segmented LRU: new blocks enter a probation segment; a hit there promotes to
    the protected segment (80%), whose overflow falls back to probation."""

    name = "SLRU"

    def __init__(self, capacity: int, protected_share: float = 0.8) -> None:
        super().__init__(capacity)
        self._max_protected = int(capacity * protected_share)
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._probation or block in self._protected

    def cached(self) -> set[int]:
        return set(self._probation) | set(self._protected)

    def hit(self, block: int) -> None:
        if block in self._protected:
            self._protected.move_to_end(block)
            return
        del self._probation[block]
        self._protected[block] = None
        if len(self._protected) > self._max_protected:
            old, _ = self._protected.popitem(last=False)
            self._probation[old] = None

    def admit(self, block: int) -> None:
        if self.capacity <= 0:
            return
        if len(self._probation) + len(self._protected) >= self.capacity:
            (self._probation or self._protected).popitem(last=False)
        self._probation[block] = None


class S3FifoPolicy(CachePolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%) filters one-hit blocks,
    a main FIFO with 2-bit frequencies reinserts reused ones, a ghost FIFO of
    evicted keys sends returning blocks straight to main."""

    name = "S3-FIFO"

    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        super().__init__(capacity)
        self._small_max = max(1, int(capacity * small_share))
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}

    def __contains__(self, block: int) -> bool:
        return block in self._freq

    def cached(self) -> set[int]:
        return set(self._freq)

    def hit(self, block: int) -> None:
        self._freq[block] = min(self._freq[block] + 1, 3)

    def admit(self, block: int) -> None:
        if self.capacity <= 0:
            return
        while len(self._freq) >= self.capacity:
            self._evict()
        if block in self._ghost:
            del self._ghost[block]
            self._main[block] = None
        else:
            self._small[block] = None
        self._freq[block] = 0

    def _evict(self) -> None:
        if len(self._small) >= self._small_max or not self._main:
            b, _ = self._small.popitem(last=False)
            if self._freq[b] > 0:
                self._freq[b] = 0
                self._main[b] = None
            else:
                del self._freq[b]
                self._ghost[b] = None
                if len(self._ghost) > self.capacity - self._small_max:
                    self._ghost.popitem(last=False)
            return
        while True:
            b, _ = self._main.popitem(last=False)
            f = self._freq[b]
            if f > 0:
                self._freq[b] = f - 1
                self._main[b] = None
            else:
                del self._freq[b]
                return


class ArcPolicy(CachePolicy):
    """ARC (Megiddo and Modha, FAST'03): recency list T1 and frequency list T2 with
    ghost lists B1 / B2 steering the target size p of T1."""

    name = "ARC"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._p = 0.0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._t1 or block in self._t2

    def cached(self) -> set[int]:
        return set(self._t1) | set(self._t2)

    def hit(self, block: int) -> None:
        if block in self._t1:
            del self._t1[block]
        else:
            del self._t2[block]
        self._t2[block] = None

    def _replace(self, in_b2: bool) -> None:
        t1_over = len(self._t1) > self._p or (in_b2 and len(self._t1) == self._p)
        if self._t1 and (t1_over or not self._t2):
            b, _ = self._t1.popitem(last=False)
            self._b1[b] = None
        else:
            b, _ = self._t2.popitem(last=False)
            self._b2[b] = None

    def admit(self, block: int) -> None:
        c = self.capacity
        if c <= 0:
            return
        if block in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            self._replace(False)
            del self._b1[block]
            self._t2[block] = None
            return
        if block in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            self._replace(True)
            del self._b2[block]
            self._t2[block] = None
            return
        l1 = len(self._t1) + len(self._b1)
        if l1 == c:
            if len(self._t1) < c:
                self._b1.popitem(last=False)
                self._replace(False)
            else:
                self._t1.popitem(last=False)
        elif l1 < c:
            total = l1 + len(self._t2) + len(self._b2)
            if total >= c:
                if total == 2 * c:
                    self._b2.popitem(last=False)
                self._replace(False)
        self._t1[block] = None


class LfuAgingPolicy(CachePolicy):
    """LFU with dynamic aging (LFU-DA): priority = age + hits, where age is the
    priority of the last evicted block; least recent first among equals."""

    name = "LFU-aging"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._age = 0
        self._clock = 0
        self._prio: dict[int, tuple[int, int]] = {}
        self._freq: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []

    def __contains__(self, block: int) -> bool:
        return block in self._prio

    def cached(self) -> set[int]:
        return set(self._prio)

    def _set(self, block: int) -> None:
        self._clock += 1
        key = (self._age + self._freq[block], self._clock)
        self._prio[block] = key
        heappush(self._heap, (*key, block))

    def hit(self, block: int) -> None:
        self._freq[block] += 1
        self._set(block)

    def admit(self, block: int) -> None:
        if self.capacity <= 0:
            return
        if len(self._prio) >= self.capacity:
            while True:
                k, t, b = heappop(self._heap)
                if self._prio.get(b) == (k, t):
                    break
            del self._prio[b], self._freq[b]
            self._age = k
        self._freq[block] = 1
        self._set(block)


class FrecencySim(CachePolicy):
    """hicache's `frecency` eviction (hicache/index/policy.py) on the block trace:
    priority = last touch + W * log2(1 + hits), W = the moving average (64 evictions)
    of how long a never-hit block stayed between its last touch and its eviction.
    Time is the request number; leaf-first touches keep parents above children."""

    name = "frecency"

    def __init__(self, capacity: int, window: int = 64) -> None:
        super().__init__(capacity)
        self._alpha = 1.0 / window
        self._lifetime = 0.0
        self._now = 0
        self._hits: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._prio: dict[int, float] = {}
        self._heap: list[tuple[float, int, int]] = []  # (priority, -touch, block), lazy

    def __contains__(self, block: int) -> bool:
        return block in self._prio

    def cached(self) -> set[int]:
        return set(self._prio)

    def request(self, ids: Sequence[int], pos: int) -> None:
        self._now += 1
        super().request(ids, pos)

    def _touch(self, block: int) -> None:
        prio = frecency(float(self._now), self._hits[block], self._lifetime)
        self._last[block] = self._now
        self._prio[block] = prio
        heappush(self._heap, (prio, -self._now, block))

    def hit(self, block: int) -> None:
        self._hits[block] += 1
        self._touch(block)

    def admit(self, block: int) -> None:
        if self.capacity <= 0:
            return
        while len(self._prio) >= self.capacity:
            prio, _, b = heappop(self._heap)
            if self._prio.get(b) != prio:
                continue
            del self._prio[b]
            last = self._last.pop(b)
            if not self._hits.pop(b):
                self._lifetime += (self._now - last - self._lifetime) * self._alpha
        self._hits[block] = 0
        self._touch(block)


ONLINE = {p.name: p for p in (LruPolicy, SlruPolicy, S3FifoPolicy, ArcPolicy, LfuAgingPolicy)}
HICACHE_POLICIES = {FrecencySim.name: FrecencySim}  # simulated as the daemon runs them


def make_policy(name: str, capacity: int, trace: BlockTrace) -> CachePolicy:
    if name == "OPT":
        return OptPolicy(capacity, trace)
    if name == "infinite":
        return InfinitePolicy()
    if name in HICACHE_POLICIES:
        return HICACHE_POLICIES[name](capacity)
    return ONLINE[name](capacity)


def replay(trace: BlockTrace, cache: CachePolicy) -> int:
    """Feed every request to `cache`; the blocks hit: each request's leading blocks the
    cache held before it (a prefix cache stops at the first miss)."""
    hit = pos = 0
    for ids in trace.requests:
        k = 0
        for b in ids:
            if b not in cache:
                break
            k += 1
        hit += k
        cache.request(ids, pos)
        pos += len(ids)
    return hit


def simulate(trace: BlockTrace, policy: CachePolicy) -> SimResult:
    hit = replay(trace, policy)
    total = trace.num_accesses
    rate = hit * trace.block_tokens / trace.prompt_tokens if trace.prompt_tokens else 0.0
    cap = policy.capacity if policy.capacity < INF else total
    return SimResult(policy.name, cap, hit, total, rate)


def simulate_all(trace: BlockTrace, capacity: int, names: Sequence[str]) -> dict[str, SimResult]:
    return {n: simulate(trace, make_policy(n, capacity, trace)) for n in names}
