"""Page ids on the wire: packed little-endian int32, whatever the caller holds them in,
and back to the int64 arrays the index uses."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import ProtocolError
from hicache.rpc.framing import bytes_to_ids, ids_to_bytes


@pytest.mark.parametrize("ids", [
    np.arange(1, 513, dtype=np.int64),           # a match reply's device pages
    np.arange(1, 513, dtype=np.int64)[::3],      # not contiguous
    np.arange(1, 9, dtype=np.int32),
    np.array([0, 1, 2**31 - 1], dtype=np.int64),
    np.arange(7, dtype=np.uint16),
    [3, 1, 2],
    range(1, 66),
])
def test_ids_travel_as_little_endian_int32_and_come_back_equal(ids):
    data = ids_to_bytes(ids)
    want = [int(x) for x in ids]
    assert data == b"".join(x.to_bytes(4, "little", signed=True) for x in want)
    back = bytes_to_ids(data)
    assert back.dtype == np.int64 and back.tolist() == want


@pytest.mark.parametrize("empty", [np.empty(0, dtype=np.int64), [], range(0)])
def test_no_ids_are_no_bytes(empty):
    assert ids_to_bytes(empty) == b"" and len(bytes_to_ids(b"")) == 0


def test_ragged_or_untyped_id_bytes_are_refused():
    with pytest.raises(ProtocolError):
        bytes_to_ids(b"\x01\x00\x00")
    with pytest.raises(ProtocolError):
        bytes_to_ids([1, 2])
