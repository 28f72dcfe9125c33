"""Request frames spliced from a template (framing.BlobRequest): byte for byte the frame
`pack_frame` makes of the same request, so any daemon reads them as before; and frame
bodies decoded with msgpack's defaults keep the limits a frame needs."""

from __future__ import annotations

import msgpack
import pytest

from hicache.errors import ProtocolError
from hicache.rpc.framing import HEADER, BlobRequest, pack_frame, unpack_body

# ids and blob lengths at each edge of msgpack's int and bin encodings
IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
BLOB_LENS = [0, 1, 255, 256, 8192, 65535, 65536, 300_000]


@pytest.mark.parametrize("fixed", [{}, {"engine": 7}, {"engine": 70000, "tier": "host", "pin": None}])
@pytest.mark.parametrize("blob_len", BLOB_LENS)
def test_a_spliced_frame_is_the_packed_dict_byte_for_byte(fixed, blob_len):
    blob = bytes(i % 251 for i in range(blob_len))
    req = BlobRequest("match", fixed, "keys")
    for req_id in IDS:
        frame = req.frame(req_id, blob)
        assert frame == pack_frame({"id": req_id, "method": "match", "params": {**fixed, "keys": blob}})
        (n,) = HEADER.unpack_from(frame)
        assert n == len(frame) - 4
        assert unpack_body(memoryview(frame)[4:]) == {"id": req_id, "method": "match",
                                                      "params": {**fixed, "keys": blob}}


def test_the_template_does_not_follow_later_changes_to_its_dict():
    fixed = {"engine": 1}
    req = BlobRequest("match", fixed, "keys")
    fixed["engine"] = 2
    assert unpack_body(req.frame(5, b"k")[4:])["params"] == {"engine": 1, "keys": b"k"}


def test_bad_templates_and_ids_are_refused():
    with pytest.raises(ValueError, match="both a fixed param and the blob"):
        BlobRequest("match", {"keys": b""}, "keys")
    req = BlobRequest("match", {"engine": 1}, "keys")
    with pytest.raises(ValueError, match="negative"):
        req.frame(-1, b"")
    with pytest.raises(OverflowError):
        req.frame(2**64, b"")


def test_bodies_keep_a_frames_limits_under_msgpacks_defaults():
    assert unpack_body(msgpack.packb({"s": "é", "b": b"\x00"})) == {"s": "é", "b": b"\x00"}
    with pytest.raises(ProtocolError):  # map keys must be str
        unpack_body(msgpack.packb({1: 2}))
    with pytest.raises(ProtocolError):  # a bin longer than the body holds
        unpack_body(b"\x81\xa1k\xc6\x7f\xff\xff\xff" + bytes(8))
    with pytest.raises(ProtocolError):  # a frame holds a map
        unpack_body(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError):
        unpack_body(b"\xc1")
