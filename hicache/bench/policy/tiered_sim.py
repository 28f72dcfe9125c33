"""hicache's host + disk tiers simulated on a trace's block sequence: placement and admission.

The flat policies of policy_sim.py hold every block in one pool. hicache has two
pools of its own (host, then disk; the device pool in front is the engine's), so
how a block gets into the lower one decides both the hit rate and the bytes
written. `TieredSim` runs that on the block trace, capacities in blocks:

- placement "inclusive" (hicache before admission): every block stored on host is
  also written to disk at once (write-through), and a host victim not on disk yet
  is written as it goes; the disk mostly mirrors the host, so the two pools hold
  about max(host, disk) distinct blocks.
- "exclusive": a block is written to disk only when the host evicts it, and a disk
  hit moves it up (its disk copy is dropped): host + disk distinct blocks, but a
  block cycling between the tiers is rewritten on every trip down.
- "non-inclusive": written when the host evicts it; a disk hit copies it up and the
  disk copy stays, so a block that goes down again costs no second write.
- admission (hicache/index/admission.py, `DiskAdmission`) filters every disk write.

Both tiers evict by frecency (hicache/index/policy.py), as the daemon does; its unit
W follows the lifetime of never-hit blocks on the disk (the last tier). A request's
blocks are touched leaf first. Counted: hits per tier and blocks written to disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

from hicache.bench.policy.policy_sim import BlockTrace, CachePolicy, replay
from hicache.bench.report import row
from hicache.index.admission import AdmissionConfig, DiskAdmission
from hicache.index.policy import frecency

PLACEMENTS = ("inclusive", "exclusive", "non-inclusive")


@dataclass(frozen=True, slots=True)
class TieredResult:
    name: str
    hit_rate: float
    disk_hit_rate: float  # hit tokens served from disk / prompt tokens
    disk_writes: int  # blocks written to disk
    disk_hits: int  # blocks served from disk

    @property
    def writes_per_disk_hit(self) -> float:
        return self.disk_writes / max(1, self.disk_hits)  # no disk hit: all the writes


class _Pool:
    """One tier: blocks ordered by frecency, a lazy heap."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.prio: dict[int, float] = {}
        self.heap: list[tuple[float, int, int]] = []  # (priority, -touch, block)

    def __contains__(self, b: int) -> bool:
        return b in self.prio

    def put(self, b: int, prio: float, now: int) -> None:
        self.prio[b] = prio
        heappush(self.heap, (prio, -now, b))

    def pop_victim(self) -> int:
        while True:
            prio, _, b = heappop(self.heap)
            if self.prio.get(b) == prio:
                del self.prio[b]
                return b


class TieredSim(CachePolicy):
    def __init__(self, host: int, disk: int, placement: str = "inclusive",
                 admission: AdmissionConfig | None = None, name: str = "") -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        super().__init__(host + disk)
        self.name = name or placement
        self.placement = placement
        self.host, self.disk = _Pool(host), _Pool(disk)
        self.admission = DiskAdmission(admission or AdmissionConfig(mode="all"), host + disk)
        self._now = 0
        self._hits: dict[int, int] = {}  # per block with a copy in some tier
        self._last: dict[int, int] = {}
        self._lifetime = 0.0
        self._alpha = 1.0 / 64
        self.disk_writes = 0
        self.disk_hits = 0

    def __contains__(self, b: int) -> bool:
        return b in self.host or b in self.disk

    def cached(self) -> set[int]:
        return set(self.host.prio) | set(self.disk.prio)

    def _prio(self, b: int) -> float:
        return frecency(float(self._last[b]), self._hits[b], self._lifetime)

    def request(self, ids: Sequence[int], pos: int) -> None:
        self._now += 1
        matched = 0
        while matched < len(ids) and ids[matched] in self:
            matched += 1
        self.disk_hits += sum(1 for b in ids[:matched] if b not in self.host)
        adm = self.admission
        adm.request(list(ids), matched)
        for b in reversed(ids):
            in_host, in_disk = b in self.host, b in self.disk
            if in_host or in_disk:
                self._hits[b] += 1
            else:
                self._hits[b] = 0
            self._last[b] = self._now
            p = self._prio(b)
            if in_disk:
                if self.placement == "exclusive" and not in_host:
                    del self.disk.prio[b]  # moves up: the heap entry goes stale
                else:
                    self.disk.put(b, p, self._now)
            if in_host:
                self.host.put(b, p, self._now)
                continue
            self._host_admit(b, p)
            if self.placement == "inclusive" and b not in self.disk:
                self._write(b)

    def _host_admit(self, b: int, p: float) -> None:
        host = self.host
        if host.capacity <= 0:
            self._write(b)
            return
        while len(host.prio) >= host.capacity:
            v = host.pop_victim()
            if v not in self.disk:
                self._write(v)
            if v not in self.disk:
                self._forget(v)
        host.put(b, p, self._now)

    def _write(self, b: int) -> None:
        disk = self.disk
        if disk.capacity <= 0:
            return
        room = len(disk.prio) < disk.capacity
        if not self.admission.admit(b, 1, room):
            return
        while len(disk.prio) >= disk.capacity:
            v = disk.pop_victim()
            if not self._hits.get(v):
                self._lifetime += (self._now - self._last[v] - self._lifetime) * self._alpha
            if v not in self.host:
                self._forget(v)
        self.disk_writes += 1
        disk.put(b, self._prio(b), self._now)

    def _forget(self, b: int) -> None:
        self._hits.pop(b, None)
        self._last.pop(b, None)


def simulate_tiered(trace: BlockTrace, sim: TieredSim) -> TieredResult:
    hit = replay(trace, sim)
    scale = trace.block_tokens / trace.prompt_tokens if trace.prompt_tokens else 0.0
    return TieredResult(sim.name, hit * scale, sim.disk_hits * scale, sim.disk_writes, sim.disk_hits)


# The ablation `bench trace` prints: today's placement, each placement with every
# disk write admitted, then the chosen one and the chosen one less each ingredient.
VARIANTS: dict[str, tuple[str, AdmissionConfig]] = {
    "inclusive, admit all (before)": ("inclusive", AdmissionConfig(mode="all")),
    "exclusive, admit all": ("exclusive", AdmissionConfig(mode="all")),
    "non-inclusive, admit all": ("non-inclusive", AdmissionConfig(mode="all")),
    "inclusive + admission": ("inclusive", AdmissionConfig()),
    "exclusive + admission": ("exclusive", AdmissionConfig()),
    "non-inclusive + admission (hicache)": ("non-inclusive", AdmissionConfig()),
    "  plus the tail signal": ("non-inclusive", AdmissionConfig(tail=True)),
    "  less the next-turn signal (sketch only)": ("non-inclusive", AdmissionConfig(next_turn=False)),
    "  less admit-while-room": ("non-inclusive", AdmissionConfig(when_room=False)),
}


def simulate_variants(trace: BlockTrace, host: int, disk: int, names: Sequence[str] | None = None
                      ) -> dict[str, TieredResult]:
    out = {}
    for name in names or VARIANTS:
        placement, adm = VARIANTS[name]
        out[name] = simulate_tiered(trace, TieredSim(host, disk, placement, adm, name))
    return out


def ablation_rows(trace: BlockTrace, label: str, host: int, disk: int, opt: float, lru: float) -> list[dict]:
    """`bench trace`'s ablation: each variant's hit rate against LRU of the same total
    capacity (and its share of the LRU-to-OPT gap), and its disk writes per disk hit
    against the placement before admission."""
    res = simulate_variants(trace, host, disk)
    before = res[next(iter(VARIANTS))]
    rows = [row(f"tiers @ {label}: host + disk capacity", host + disk, "blocks", host_blocks=host, disk_blocks=disk)]
    for name, r in res.items():
        gap = f"gap closed {(r.hit_rate - lru) / (opt - lru):+.3f}" if opt > lru else ""
        rows.append(row(f"tiers @ {label}: {name.strip()}: hit rate", r.hit_rate, "fraction", baseline=lru,
                        baseline_name="LRU", note=gap))
        rows.append(row(f"tiers @ {label}: {name.strip()}: disk writes per disk hit", r.writes_per_disk_hit,
                        "blocks", baseline=before.writes_per_disk_hit, baseline_name="before"))
    return rows
