"""Device and host pools simulated on a trace's block sequence: placement between them.

The device pool is the engine's (vLLM's or SGLang's GPU blocks), the host pool is
hicache's. Which copies the two keep decides both how many distinct blocks they
hold and how many pages cross PCIe. `DeviceHostSim` runs the three placements,
both pools LRU, capacities in blocks; every block of a request ends on the device
(the engine computes or loads it there):

- "inclusive" (hicache today): every page the device computes is copied to host at
  once (write-through backup), a host hit is copied up and stays on host; the device
  is mostly a subset of the host, so the pair holds about max(device, host) blocks.
- "exclusive": a page lives on one of them: the device's victim moves down to host,
  a host hit moves up (the host copy is dropped), and a host copy behind the first
  miss is dropped too (the engine recomputes that block on device).
- "non-inclusive": the device's victim is copied down unless the host has it; a
  host hit is copied up and stays.

Counted: hits per pool, pages copied device to host (backups, write-backs) and host
to device (loads). The bytes are those pages times the page size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.bench.policy.policy_sim import BlockTrace, CachePolicy, replay
from hicache.bench.report import row

PLACEMENTS = ("inclusive", "exclusive", "non-inclusive")


@dataclass(frozen=True, slots=True)
class DeviceHostResult:
    placement: str
    hit_rate: float  # hit tokens / prompt tokens, device and host
    host_hit_rate: float  # the part served from host
    copied_down: int  # pages copied device -> host
    copied_up: int  # pages copied host -> device

    @property
    def copied(self) -> int:
        return self.copied_down + self.copied_up


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.od: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.od

    def touch(self, b: int) -> int | None:
        """Make `b` most recent (inserting it); the block evicted for it, if any."""
        if b in self.od:
            self.od.move_to_end(b)
            return None
        victim = self.od.popitem(last=False)[0] if len(self.od) >= self.capacity else None
        self.od[b] = None
        return victim


class DeviceHostSim(CachePolicy):
    def __init__(self, device: int, host: int, placement: str = "inclusive") -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if device < 1 or host < 0:
            raise ValueError(f"need device >= 1 and host >= 0 blocks, got {device} and {host}")
        super().__init__(device + host)
        self.name = self.placement = placement
        self.device, self.host = _Lru(device), _Lru(host)
        self.host_hits = self.copied_down = self.copied_up = 0

    def __contains__(self, b: int) -> bool:
        return b in self.device or b in self.host

    def cached(self) -> set[int]:
        return set(self.device.od) | set(self.host.od)

    def request(self, ids: Sequence[int], pos: int) -> None:
        matched = 0
        while matched < len(ids) and ids[matched] in self:
            matched += 1
        for depth in range(len(ids) - 1, -1, -1):  # leaf first, as the engine frees them
            b = ids[depth]
            on_device, on_host = b in self.device, b in self.host
            if not on_device and on_host and depth < matched:
                self.host_hits += 1
                self.copied_up += 1
            if on_host and self.placement == "exclusive" and not on_device:
                del self.host.od[b]  # moved up, or recomputed behind the first miss
            elif on_host:
                self.host.touch(b)
            victim = self.device.touch(b)
            if victim is not None:
                self._device_evicted(victim)
            if self.placement == "inclusive" and not (on_device or on_host) and self.host.capacity:
                self.copied_down += 1  # the write-through backup of a page just computed
                self.host.touch(b)

    def _device_evicted(self, b: int) -> None:
        if self.placement == "inclusive" or b in self.host or not self.host.capacity:
            return  # its host copy (if the host kept one) is all that is left
        self.copied_down += 1
        self.host.touch(b)


def simulate_device_host(trace: BlockTrace, sim: DeviceHostSim) -> DeviceHostResult:
    hit = replay(trace, sim)
    scale = trace.block_tokens / trace.prompt_tokens if trace.prompt_tokens else 0.0
    return DeviceHostResult(sim.placement, hit * scale, sim.host_hits * scale, sim.copied_down, sim.copied_up)


def device_host_rows(trace: BlockTrace, label: str, device: int, host: int, opt: float, lru: float) -> list[dict]:
    """Each placement's hit rate against LRU of device + host capacity, and its pages
    copied (both ways) per hit page against inclusive's."""
    res = {p: simulate_device_host(trace, DeviceHostSim(device, host, p)) for p in PLACEMENTS}
    hit_pages = {p: r.hit_rate * trace.prompt_tokens / trace.block_tokens for p, r in res.items()}
    per_hit = {p: r.copied / max(1.0, hit_pages[p]) for p, r in res.items()}
    rows = [row(f"device-host @ {label}: device + host capacity", device + host, "blocks",
                device_blocks=device, host_blocks=host)]
    for p, r in res.items():
        gap = f"gap closed {(r.hit_rate - lru) / (opt - lru):+.3f}" if opt > lru else ""
        rows.append(row(f"device-host @ {label}: {p}: hit rate", r.hit_rate, "fraction", baseline=lru,
                        baseline_name="LRU", host_hit_rate=r.host_hit_rate, note=gap))
        rows.append(row(f"device-host @ {label}: {p}: pages copied", r.copied, "pages",
                        baseline=res["inclusive"].copied, baseline_name="inclusive",
                        device_to_host=r.copied_down, host_to_device=r.copied_up))
        rows.append(row(f"device-host @ {label}: {p}: pages copied per hit page", per_hit[p], "pages",
                        baseline=per_hit["inclusive"], baseline_name="inclusive"))
    return rows
