"""Frames: a 4-byte big-endian length, then one msgpack map. No pickle anywhere.

Token ids and page ids travel as packed little-endian int32 `bin` values:
a msgpack list of 4096 ints costs ~50 µs a round trip, a `bin` of the same
ids under a microsecond (see LIMITS.md).
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

from hicache.errors import ProtocolError

HEADER = struct.Struct(">I")
_unpackb = msgpack.unpackb


def new_packer() -> msgpack.Packer:
    """A Packer for one thread's use (they are not thread-safe): reusing one saves about
    half a microsecond a frame over `msgpack.packb`, which builds a Packer every call."""
    return msgpack.Packer(use_bin_type=True)


def pack_frame(msg: dict, packer: msgpack.Packer | None = None) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True) if packer is None else packer.pack(msg)
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | memoryview) -> dict:
    """Decode one frame body; anything but a msgpack map is a ProtocolError.

    msgpack >= 1.0's defaults are what a frame needs (str keys only, str as str, no
    string or bin longer than the body): spelling them out cost ~1.5 µs a call in
    keyword parsing, on every request and reply."""
    try:
        msg = _unpackb(body)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must hold a msgpack map")
    return msg


class BlobRequest:
    """Request frames of one method whose params are fixed values and, last, one bin
    (a match's key blob): all but the id and the blob packed once, both spliced in
    per call. The frame is byte for byte what `pack_frame` makes of
    `{"id", "method", "params": {**fixed, blob_key: blob}}`, so any daemon reads it;
    it skips the dict, the packer's two copies of the blob and the header's
    concatenation (~2 µs a call for an 8 KiB blob)."""

    __slots__ = ("method", "fixed", "_mid")

    def __init__(self, method: str, fixed: dict, blob_key: str) -> None:
        if blob_key in fixed:
            raise ValueError(f"{blob_key!r} is both a fixed param and the blob")
        p = new_packer()
        self.method = method
        self.fixed = dict(fixed)
        # the request map's three keys: "id" (spliced in), "method", "params" (the blob last)
        self._mid = (p.pack("method") + p.pack(method) + p.pack("params") + p.pack_map_header(len(fixed) + 1)
                     + b"".join(p.pack(k) + p.pack(v) for k, v in fixed.items()) + p.pack(blob_key))

    def frame(self, req_id: int, blob: bytes) -> bytes:
        n = len(blob)
        if n < 0x100:
            bin_header = b"\xc4" + n.to_bytes(1, "big")
        elif n < 0x10000:
            bin_header = b"\xc5" + n.to_bytes(2, "big")
        else:
            bin_header = b"\xc6" + n.to_bytes(4, "big")  # over 4 GiB: to_bytes raises OverflowError
        rid = _pack_uint(req_id)
        size = 4 + len(rid) + len(self._mid) + len(bin_header) + n
        return b"".join((HEADER.pack(size), _REQUEST_ID, rid, self._mid, bin_header, blob))


_REQUEST_ID = b"\x83\xa2id"  # a map of three entries, the first keyed "id"


def _pack_uint(n: int) -> bytes:
    """msgpack of a request id (a positive int, as the connection counts them)."""
    if 0 <= n < 0x80:
        return n.to_bytes(1, "big")
    if n < 0:
        raise ValueError(f"request id {n} is negative")
    for tag, width in ((b"\xcc", 1), (b"\xcd", 2), (b"\xce", 4), (b"\xcf", 8)):
        if n < 1 << (8 * width):
            return tag + n.to_bytes(width, "big")
    raise OverflowError(f"request id {n} does not fit msgpack")


class FrameDecoder:
    """Incremental decoder for a byte stream of frames (server and async client).

    The server takes frames one at a time (`append`, then `next_frame`) so that it
    can stop between them; `feed` takes all complete ones at once.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def append(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete frame body, or None. An oversized frame breaks the stream."""
        buf = self._buf
        if len(buf) < 4:
            return None
        (n,) = HEADER.unpack_from(buf, 0)
        if n > self.max_frame_bytes:
            raise ProtocolError(f"frame of {n} bytes exceeds the cap of {self.max_frame_bytes}")
        if len(buf) - 4 < n:
            return None
        body = bytes(buf[4:4 + n])
        del buf[:4 + n]  # O(1): bytearray drops a prefix by moving its start
        return body

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return complete frame bodies. Oversized frames break the stream."""
        self.append(data)
        out: list[bytes] = []
        while (body := self.next_frame()) is not None:
            out.append(body)
        return out


_WIRE_IDS = np.dtype("<i4")
_INDEX_IDS = np.dtype(np.int64)


def ids_to_bytes(ids: np.ndarray | list[int]) -> bytes:
    # On every match reply: `astype` with a dtype object costs about 0.6 µs less than
    # `ascontiguousarray(ids, dtype="<i4")` for 512 ids (both copy into a new C-order array).
    if type(ids) is np.ndarray:
        return ids.astype(_WIRE_IDS).tobytes() if ids.size else b""
    return np.asarray(ids, dtype=_WIRE_IDS).tobytes() if len(ids) else b""


def bytes_to_ids(data: bytes, name: str = "ids") -> np.ndarray:
    """Packed little-endian int32 -> int64 array (int64 is what indexing wants)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{name} must be packed int32 bytes")
    if len(data) % 4:
        raise ProtocolError(f"{name}: byte length {len(data)} is not a multiple of 4")
    # dtype objects, not strings: ~0.35 µs less a call, twice per match reply
    return np.frombuffer(data, dtype=_WIRE_IDS).astype(_INDEX_IDS)
