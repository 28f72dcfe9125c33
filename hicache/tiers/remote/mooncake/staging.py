"""Staging: the extents of the memfd area a daemon shares with its Mooncake helper.

A put or get reserves one contiguous extent for its records and frees it when the
helper is done with it. First fit over a sorted free list, neighbours merged on free:
a handful of calls are outstanding at most (HELPER_THREADS), so a list is enough.
A request that does not fit now waits until enough is freed (its caller's deadline
bounds the wait). Used on one event loop only: not thread-safe.
"""

from __future__ import annotations

import asyncio
import bisect

from hicache.tiers.remote.store import RemoteStoreError

ALIGN = 4096  # records start on a page: the transfer engine copies whole ranges


class Staging:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self._freed: asyncio.Event | None = None
        self.used = 0

    def try_alloc(self, nbytes: int) -> int | None:
        size = _aligned(nbytes)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.used += size
                return offset
        return None

    async def alloc(self, nbytes: int) -> int:
        """The offset of `nbytes` of staging space, waiting until some is freed."""
        if _aligned(nbytes) > self.capacity:
            raise RemoteStoreError(f"{nbytes} bytes do not fit the {self.capacity}-byte staging area "
                                   "(raise staging_mib)")
        while (offset := self.try_alloc(nbytes)) is None:
            if self._freed is None:
                self._freed = asyncio.Event()
            await self._freed.wait()
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        size = _aligned(nbytes)
        self.used -= size
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge the next extent
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))
        if self._freed is not None:  # wake every waiter: each retries its own size
            self._freed.set()
            self._freed = None


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
