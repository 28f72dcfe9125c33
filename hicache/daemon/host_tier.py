"""The daemon's host tier: one memfd arena shared by every namespace.

Engines of different models have different page sizes, yet all share one
host budget. The arena is cut into equal *slabs*; a page-size class takes
slabs as it grows and gives an empty slab back, so the budget moves between
models dynamically without moving any page. A class numbers its pages by
byte offset (`slot * page_bytes`), so an engine's `HostKVCache` maps the whole
arena and indexes it with no per-class translation; pages never straddle
slab boundaries.
"""

from __future__ import annotations

import logging

import numpy as np

from hicache.errors import HiCacheError
from hicache.tiers.arena import HostArena, HostSlotAllocator

log = logging.getLogger(__name__)

MIN_SLAB_BYTES = 1 << 20
SLABS_PER_ARENA = 64


class PageClass:
    """The host pages of one byte size, spread over the slabs it holds."""

    def __init__(self, tier: HostTier, page_bytes: int) -> None:
        self.tier = tier
        self.page_bytes = page_bytes
        self.slabs: dict[int, HostSlotAllocator] = {}  # slab index -> allocator over its pages
        self.used_pages = 0

    def _slab_range(self, slab: int) -> tuple[int, int]:
        start = slab * self.tier.slab_bytes
        first = -(-start // self.page_bytes)  # ceil: first whole page inside the slab
        last = (start + self.tier.slab_bytes) // self.page_bytes  # exclusive
        return first, last - first

    @property
    def capacity_pages(self) -> int:
        return sum(a.count for a in self.slabs.values())

    def available(self) -> int:
        return sum(a.available() for a in self.slabs.values())

    def alloc(self, n: int) -> np.ndarray | None:
        """n page ids, or None (nothing taken) when the arena cannot hold them now."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        have = self.available()
        while have < n:
            slab = self.tier.take_slab()
            if slab is None:
                return None
            first, count = self._slab_range(slab)
            self.slabs[slab] = HostSlotAllocator(first, count)
            have += count
        parts: list[np.ndarray] = []
        need = n
        for alloc in self.slabs.values():
            take = min(need, alloc.available())
            if take:
                got = alloc.alloc(take)
                assert got is not None
                parts.append(got)
                need -= take
            if not need:
                break
        self.used_pages += n
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def free(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=np.int64)
        slab_of = (ids * self.page_bytes) // self.tier.slab_bytes
        for slab in np.unique(slab_of):
            alloc = self.slabs.get(int(slab))
            if alloc is None:
                raise HiCacheError(f"host pages {ids[slab_of == slab][:4]} are not in this page class")
            alloc.free(ids[slab_of == slab])
        self.used_pages -= len(ids)
        # Give empty slabs back so other page sizes can grow into them.
        for slab in [s for s, a in self.slabs.items() if a.available() == a.count]:
            if len(self.slabs) > 1 or self.tier.classes_waiting():
                del self.slabs[slab]
                self.tier.return_slab(slab)


class HostTier:
    def __init__(self, capacity_bytes: int, mlock: bool = True) -> None:
        slab = max(MIN_SLAB_BYTES, capacity_bytes // SLABS_PER_ARENA)
        slab -= slab % 4096
        self.slab_bytes = slab
        self.num_slabs = max(1, capacity_bytes // slab)
        self.arena = HostArena.create(self.num_slabs * slab, mlock=mlock)
        self.capacity_bytes = self.arena.nbytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self.classes: dict[int, PageClass] = {}
        self._starved = 0  # classes that asked for a slab and found none

    def page_class(self, page_bytes: int) -> PageClass:
        if page_bytes > self.slab_bytes:
            raise HiCacheError(
                f"a page of {page_bytes} bytes does not fit a host slab of {self.slab_bytes} bytes; "
                f"raise --host-capacity to at least {page_bytes * SLABS_PER_ARENA} bytes")
        cls = self.classes.get(page_bytes)
        if cls is None:
            cls = self.classes[page_bytes] = PageClass(self, page_bytes)
        return cls

    def take_slab(self) -> int | None:
        if self._free_slabs:
            return self._free_slabs.pop()
        self._starved += 1
        return None

    def return_slab(self, slab: int) -> None:
        self._free_slabs.append(slab)
        self._starved = 0

    def classes_waiting(self) -> bool:
        return self._starved > 0 and len(self.classes) > 1

    @property
    def used_bytes(self) -> int:
        return sum(c.used_pages * c.page_bytes for c in self.classes.values())

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def close(self) -> None:
        self.arena.close()
