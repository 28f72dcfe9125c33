"""Bad input gets a clear error and leaves the index exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import HiCacheError
from hicache.index.radix import IndexInputError, IndexStateError, RadixIndex, Tier
from radix_util import PS, SALT, check_invariants, ids, make_index, seq, snapshot

DEV, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


@pytest.fixture
def populated():
    idx = make_index()
    ka, ta = seq(1, 2, 3, 4)
    kb, tb = seq(1, 2, 7)
    a = idx.insert(ka, ta, engine=0, device_pages=ids(1, 2, 3, 4), host_pages=ids(9, 10, 11, 12)).nodes[-1]
    b = idx.insert(kb, tb, on_disk=True).nodes[-1]
    idx.lock(b, DISK)
    idx.lock(b.parent, HOST)
    idx.lock(a, DEV, engine=0)
    return idx, a, b, ka, ta


def bad_calls(idx, a, b, ka, ta):
    other = make_index()
    foreign = other.insert(*seq(1), host_pages=ids(0)).nodes[-1]
    short = [k[:15] for k in ka]
    yield "keys not a list", lambda: idx.match("abc")
    yield "short key", lambda: idx.match(short)
    yield "str key", lambda: idx.match([k.hex() for k in ka])
    yield "negative engine", lambda: idx.match(ka, engine=-1)
    yield "bool engine", lambda: idx.match(ka, engine=True)
    yield "str engine", lambda: idx.match(ka, engine="0")
    yield "tokens too short", lambda: idx.insert(ka, ta[:-1], host_pages=ids(0, 1, 2, 3))
    yield "tokens 2-D", lambda: idx.insert(ka, ta.reshape(4, PS), host_pages=ids(0, 1, 2, 3))
    yield "device pages without engine", lambda: idx.insert(ka, ta, device_pages=ids(0, 1, 2, 3))
    yield "int32 pages", lambda: idx.insert(ka, ta, engine=0, device_pages=np.arange(4, dtype=np.int32))
    yield "list pages", lambda: idx.insert(ka, ta, host_pages=[0, 1, 2, 3])
    yield "pages too short", lambda: idx.insert(ka, ta, host_pages=ids(0, 1, 2))
    yield "negative page", lambda: idx.insert(ka, ta, host_pages=ids(0, 1, 2, -3))
    yield "on_disk not bool", lambda: idx.insert(ka, ta, on_disk="yes")
    yield "no residency", lambda: idx.insert(ka, ta)
    yield "set_device past the root", lambda: idx.set_device(a, 1, ids(*range(5)))
    yield "set_host 2-D", lambda: idx.set_host(a, np.zeros((2, 2), np.int64))
    yield "set_disk flag", lambda: idx.set_disk(a, 1)
    yield "set_disk count", lambda: idx.set_disk(a, True, num_pages=-1)
    yield "set_disk too long", lambda: idx.set_disk(a, True, num_pages=5)
    yield "unmark a locked disk copy", lambda: idx.set_disk(b, False, num_pages=3)
    yield "bad tier", lambda: idx.lock(a, 7)
    yield "lock the root", lambda: idx.lock(idx.root, HOST)
    yield "lock a foreign node", lambda: idx.lock(foreign, HOST)
    yield "not a node", lambda: idx.lock("node", HOST)
    yield "unlock below zero", lambda: idx.unlock(a, HOST)
    yield "unlock another engine", lambda: idx.unlock(a, DEV, engine=1)
    yield "unlock all engines", lambda: idx.unlock(a, DEV)
    yield "evict device without engine", lambda: idx.evict(DEV, 1)
    yield "evict negative", lambda: idx.evict(HOST, -1)
    yield "evict float", lambda: idx.evict(HOST, 1.5)
    yield "peek bad tier", lambda: idx.peek_evictable(5)
    yield "clear a locked host copy", lambda: idx.clear_host(b.parent)
    yield "clear a locked device copy", lambda: idx.clear_device(a, 0)
    yield "remove engine -1", lambda: idx.remove_engine(-1)
    yield "flush bad tier", lambda: idx.flush("HOST")
    yield "num_pages bad engine", lambda: idx.num_pages(DEV, "x")


def test_every_bad_call_raises_a_clear_error_and_changes_nothing(populated):
    idx, a, b, ka, ta = populated
    before = snapshot(idx)
    for what, call in bad_calls(idx, a, b, ka, ta):
        with pytest.raises((IndexInputError, IndexStateError)):
            call()
        assert snapshot(idx) == before, what
    check_invariants(idx, [(b, DISK, None), (b.parent, HOST, None), (a, DEV, 0)])


def test_error_types_are_hicache_errors_and_input_errors_are_value_errors():
    assert issubclass(IndexInputError, HiCacheError) and issubclass(IndexInputError, ValueError)
    assert issubclass(IndexStateError, HiCacheError)


def test_constructor_rejects_bad_page_size_and_salt():
    with pytest.raises(IndexInputError):
        RadixIndex(0, SALT)
    with pytest.raises(IndexInputError):
        RadixIndex(4, b"short")


def test_caller_buffers_are_copied_and_stored_arrays_are_read_only():
    idx = make_index()
    k, t = seq(1, 2)
    pages = ids(5, 6)
    node = idx.insert(k, t, engine=0, device_pages=pages).nodes[-1]
    pages[:] = 99                     # the caller reuses its buffer
    assert node.device[0].tolist() == [5, 6]
    with pytest.raises(ValueError):
        node.device[0][0] = 1
    t[:] = 0
    assert node.tokens.tolist() == np.repeat([1, 2], PS).tolist()
