"""The Mooncake staging area's extents: first fit, neighbours merged on free, a request
that does not fit waits for a free, one larger than the area is refused."""

from __future__ import annotations

import asyncio

import pytest

from hicache.tiers.remote.mooncake.staging import ALIGN, Staging
from hicache.tiers.remote.store import RemoteStoreError


def test_extents_are_aligned_first_fit_and_merge_back():
    st = Staging(8 * ALIGN)
    a = st.try_alloc(1)  # one byte takes an aligned extent
    b = st.try_alloc(2 * ALIGN)
    c = st.try_alloc(ALIGN + 1)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and st.used == 5 * ALIGN
    assert st.try_alloc(4 * ALIGN) is None  # 3 pages left
    st.free(b, 2 * ALIGN)
    assert st.try_alloc(2 * ALIGN) == ALIGN  # the hole is reused first
    st.free(ALIGN, 2 * ALIGN)
    st.free(a, 1)
    st.free(c, ALIGN + 1)
    assert st.used == 0 and st.try_alloc(8 * ALIGN) == 0  # everything merged into one extent


def test_a_request_that_does_not_fit_waits_for_a_free():
    async def scenario():
        st = Staging(4 * ALIGN)
        first = await st.alloc(3 * ALIGN)
        waiter = asyncio.ensure_future(st.alloc(2 * ALIGN))
        await asyncio.sleep(0)
        assert not waiter.done()
        st.free(first, 3 * ALIGN)
        assert await asyncio.wait_for(waiter, 5) == 0
        with pytest.raises(RemoteStoreError, match="staging_mib"):
            await st.alloc(5 * ALIGN)
    asyncio.run(scenario())
