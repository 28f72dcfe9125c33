"""The daemon's host tier: one arena of slabs, each slab owned by one namespace.

Engines of different models and tenants share one host budget, but no engine
may see another namespace's pages. The arena is cut into equal *slabs*, each
backed by its own memfd (hicache/tiers/host/arena.py); a slab belongs to at most one
owner (a namespace salt) at a time, and only its owner's engines are sent its
fd (`slabs_of`). An owner's *page class* (one per page size and kind: KV
pages, or a hybrid model's state checkpoints) takes slabs as it grows and
gives an empty slab back. A free slab keeps its memfd while only its last
owner could want it again (that owner's engines still map it); before another
owner gets it, it is punched out and backed anew, so nobody's old mapping of
it ever shows the next owner's bytes. When no slab is
free, CacheService takes one from the namespace with the oldest pages
(hicache/daemon/core/slab_reclaim.py): the budget moves between namespaces without
any engine seeing across.

A page class that grows keeps *spare* slabs: after an allocation it takes free
slabs until it has room for another allocation as large as its largest one
(at most a quarter of the arena; only clean slabs or its owner's own; an engine
that names its store size when it registers gets that room at once), and
keeps emptied slabs up to that room instead of giving them back. A spare slab
is its owner's like any other (only its engines map it), so they map it and
pre-fault it before the store that writes into it, not during that store's
copy. Spare slabs hold no page: they count in no usage or quota, and a class
that needs a slab when none is free takes another class's spare first
(punched out and backed anew, as any slab changing owner).

Page ids stay byte offsets (`slot * page_bytes`) into the whole arena, so an
engine's HostKVCache indexes its mapping with no per-class translation; pages
never straddle slab boundaries. Each owner has a *slab version*, bumped when it
gains a slab: replies that name host pages carry it, and an engine whose
mapping is older asks for the new fds (`map_slabs`) before copying.
"""

from __future__ import annotations

import logging

import numpy as np

from hicache.errors import HiCacheError
from hicache.tiers.host.arena import MAX_SLABS, HostArena
from hicache.tiers.host.slots import HostSlotAllocator

log = logging.getLogger(__name__)

MIN_SLAB_BYTES = 1 << 20
SLABS_PER_ARENA = 64
SPARE_SHARE = 4  # a page class keeps at most 1/SPARE_SHARE of the arena's slabs spare


class PageClass:
    """The host pages of one owner and one byte size, spread over the slabs it holds."""

    def __init__(self, tier: HostTier, owner: bytes, page_bytes: int, kind: str) -> None:
        self.tier = tier
        self.owner = owner
        self.page_bytes = page_bytes
        self.kind = kind
        self.slabs: dict[int, HostSlotAllocator] = {}  # slab index -> allocator over its pages
        self.used_pages = 0
        self.spare_pages = 0  # free pages to keep ahead: the largest allocation, capped (module doc)

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

    def slab_of(self, ids: np.ndarray) -> np.ndarray:
        return (np.asarray(ids, dtype=np.int64) * self.page_bytes) // self.tier.slab_bytes

    def alloc(self, n: int, *, spare: bool = True) -> np.ndarray | None:
        """n page ids, or None (nothing taken) when the arena cannot hold them now. Not
        `spare`: an internal move (slab reclaim), which is no store and sets no spare target."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        have = self.available()
        while have < n:
            slab = self.tier.take_slab(self)
            if slab is None:
                return None
            have += self._add_slab(slab)
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
        if spare:
            self._keep_spare(n, have - n)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _add_slab(self, slab: int) -> int:
        first, count = self._slab_range(slab)
        self.slabs[slab] = HostSlotAllocator(first, count)
        return count

    def expect_stores(self, n: int) -> None:
        """Keep spare room for stores of `n` pages from now on (an engine names its store
        size when it registers), so even the first store finds its slabs mapped and
        pre-faulted by its engines, within the class's share."""
        if n > 0:
            self._keep_spare(n, self.available())

    def _keep_spare(self, n: int, have: int) -> None:
        """Take free slabs (clean ones or the owner's own) until `have` free pages cover
        an allocation as large as the largest so far, within the class's share."""
        tier = self.tier
        per_slab = tier.slab_bytes // self.page_bytes
        self.spare_pages = max(self.spare_pages, min(n, per_slab * (tier.num_slabs // SPARE_SHARE)))
        while have < self.spare_pages and tier.free_slabs:
            slab = tier.take_slab(self, spare=True)
            if slab is None:
                return
            have += self._add_slab(slab)

    def free(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=np.int64)
        slab_of = self.slab_of(ids)
        for slab in np.unique(slab_of):
            alloc = self.slabs.get(int(slab))
            if alloc is None:
                raise HiCacheError(f"host pages {ids[slab_of == slab][:4]} are not in this page class")
            alloc.free(ids[slab_of == slab])
        self.used_pages -= len(ids)
        # Give empty slabs beyond the spare back so other namespaces and page sizes can
        # grow into them (all of them when a class found no slab).
        waiting = self.tier.classes_waiting()
        have = self.available()
        for slab in [s for s, a in self.slabs.items() if a.available() == a.count]:
            count = self.slabs[slab].count
            if waiting or len(self.slabs) > 1 and have - count >= self.spare_pages:
                self.release_slab(slab)
                have -= count

    def release_slab(self, slab: int) -> None:
        """Give an empty slab back to the tier."""
        alloc = self.slabs.pop(slab)
        assert alloc.available() == alloc.count, "only an empty slab goes back"
        self.tier.return_slab(slab)

    def used_in(self, slab: int) -> int:
        alloc = self.slabs[slab]
        return alloc.count - alloc.available()

    def empty_slab(self) -> int | None:
        """A slab of this class holding no page (a spare), if any."""
        return next((s for s, a in self.slabs.items() if a.available() == a.count), None)


class HostTier:
    def __init__(self, capacity_bytes: int, mlock: bool = True) -> None:
        slab = max(MIN_SLAB_BYTES, capacity_bytes // SLABS_PER_ARENA)
        slab -= slab % 4096
        self.slab_bytes = slab
        self.num_slabs = min(MAX_SLABS, max(1, capacity_bytes // slab))
        self.arena = HostArena.create(self.num_slabs * slab, mlock=mlock, slab_bytes=slab)
        self.capacity_bytes = self.arena.nbytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self.owner_of: list[bytes | None] = [None] * self.num_slabs
        self._last_owner: list[bytes | None] = [None] * self.num_slabs  # whose bytes a free slab may hold
        self.classes: dict[tuple[bytes, int, str], PageClass] = {}
        self.slab_versions: dict[bytes, int] = {}  # owner -> slab_version(owner); read-only outside
        self._starved = 0  # classes that asked for a slab and found none
        self.slabs_reassigned = 0  # slabs punched out and backed anew for another owner

    @property
    def max_page_bytes(self) -> int:
        """Pages do not straddle slabs and a slab's first page starts where the previous
        slab's last one ends: only a slab of two pages or more surely holds a whole one."""
        return self.slab_bytes // 2

    def page_class(self, owner: bytes, page_bytes: int, kind: str = "kv") -> PageClass:
        if page_bytes > self.max_page_bytes:
            raise HiCacheError(
                f"a page of {page_bytes} bytes needs host slabs of at least twice that, and they are "
                f"{self.slab_bytes} bytes; raise --host-capacity to at least "
                f"{2 * page_bytes * SLABS_PER_ARENA} bytes")
        key = (owner, page_bytes, kind)
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = PageClass(self, owner, page_bytes, kind)
        return cls

    def take_slab(self, cls: PageClass, *, spare: bool = False) -> int | None:
        """A free slab for `cls`: one its owner held before (its engines still map it), else
        a clean one, else another owner's old one, punched out and backed anew first. With
        none free, another class's spare slab is lent back first. A `spare` is only taken
        free and never from another owner."""
        free = self._free_slabs
        if not free and not spare:
            self._lend_spare(cls)
        if not free:
            self._starved += not spare
            return None
        last = self._last_owner
        pick = next((i for i in range(len(free) - 1, -1, -1) if last[free[i]] == cls.owner), None)
        if pick is None:
            pick = next((i for i in range(len(free) - 1, -1, -1) if last[free[i]] is None), None)
        if pick is None:
            if spare:  # a spare never costs another owner the slab its engines still map
                return None
            pick = len(free) - 1
        slab = free.pop(pick)
        if last[slab] not in (None, cls.owner):
            self.arena.back_slab(slab)
            self.slabs_reassigned += 1
        self.owner_of[slab] = last[slab] = cls.owner
        self.slab_versions[cls.owner] = self.slab_versions.get(cls.owner, 0) + 1
        if not self.arena.locked:  # an mlocked slab is resident and mapped already
            self.arena.prefault_async(slab, allocate=True)  # its memory, off the request path
        return slab

    def _lend_spare(self, cls: PageClass) -> None:
        """Free one empty slab of another class (its spare), so `cls` can take it."""
        for other in self.classes.values():
            if other is not cls and (slab := other.empty_slab()) is not None:
                other.release_slab(slab)
                return

    def return_slab(self, slab: int) -> None:
        self.owner_of[slab] = None
        self._free_slabs.append(slab)
        self._starved = 0

    def forget_class(self, cls: PageClass) -> None:
        """An empty page class goes away (its namespace did), giving back its slabs."""
        assert cls.used_pages == 0, "only an empty page class is forgotten"
        for slab in list(cls.slabs):
            cls.release_slab(slab)
        self.classes.pop((cls.owner, cls.page_bytes, cls.kind), None)

    def classes_waiting(self) -> bool:
        return self._starved > 0 and len(self.classes) > 1

    # -- what an owner's engines may map ----------------------------------------------
    def slab_version(self, owner: bytes) -> int:
        """Bumped whenever `owner` gains a slab (engines remap when theirs is older)."""
        return self.slab_versions.get(owner, 0)

    def slabs_of(self, owner: bytes) -> list[tuple[int, int]]:
        """(slab, generation) of every slab `owner` holds now."""
        return [(s, self.arena.slab_gen(s)) for s, o in enumerate(self.owner_of) if o == owner]

    @property
    def used_bytes(self) -> int:
        return sum(c.used_pages * c.page_bytes for c in self.classes.values())

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    @property
    def spare_slabs(self) -> int:
        """Slabs owned by a page class and holding no page (stats)."""
        return sum(a.available() == a.count for c in self.classes.values() for a in c.slabs.values())

    def close(self) -> None:
        self.arena.close()
