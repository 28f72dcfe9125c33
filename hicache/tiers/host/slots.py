"""The page-slot allocator of one host slab: which slot ids of the slab are free."""

from __future__ import annotations

import numpy as np

from hicache.tiers.host.arena import HostCacheError


class HostSlotAllocator:
    """Hands out host page-slot ids `first .. first+count-1`.

    A numpy stack of free ids plus a used mask: alloc and free are vectorized and
    O(n) in the ids moved. Freed ids are reused first (warm memory). Not thread-safe
    (the daemon's event loop owns it).
    """

    def __init__(self, first: int, count: int) -> None:
        if first < 0 or count <= 0:
            raise HostCacheError(f"need first >= 0 and count > 0, got first={first} count={count}")
        self.first = first
        self.count = count
        # Top of the stack is the end of the array; the lowest ids come out first.
        self._stack = np.arange(first + count - 1, first - 1, -1, dtype=np.int64)
        self._top = count
        self._used = np.zeros(count, dtype=bool)

    def available(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free ids (ascending on a fresh allocator), or None with nothing taken."""
        if n < 0:
            raise HostCacheError(f"cannot allocate {n} slots")
        if n > self._top:
            return None
        ids = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._used[ids - self.first] = True
        return ids

    def free(self, ids: np.ndarray | list[int]) -> None:
        """Return ids; out-of-range, repeated or not-allocated ids raise and free nothing."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return
        rel = ids - self.first
        if rel.min() < 0 or rel.max() >= self.count:
            raise HostCacheError(f"slot ids outside [{self.first}, {self.first + self.count}): "
                                 f"{ids[(rel < 0) | (rel >= self.count)][:8].tolist()}")
        if len(np.unique(rel)) != len(rel):
            raise HostCacheError("slot ids repeated in one free")
        if not self._used[rel].all():
            raise HostCacheError(f"double free of slot ids {ids[~self._used[rel]][:8].tolist()}")
        self._used[rel] = False
        self._stack[self._top:self._top + len(ids)] = ids[::-1]
        self._top += len(ids)
