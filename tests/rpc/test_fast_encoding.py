"""The native frame loop's fast path in-process (hicache/rpc/native_fast_reply.c): the
reply C encodes from a fast handler's tuple is byte for byte what the packer makes of the
Python handler's dict, over the int formats, page-id dtypes and request ids; what the
fast handler declines, and what comes before hello, takes the Python path."""

from __future__ import annotations


import msgpack
import numpy as np
import pytest

from hicache.rpc.framing import pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION

from tests.rpc.test_native_conn import needs_native, serving
from tests.rpc.wire import raw, recv_raw


@pytest.fixture(scope="module", autouse=True)
def _on_each_frame_loop():
    """The native loop only: the asyncio one has no fast path (overrides tests/rpc/conftest.py)."""


# What the "match" handlers answer: (pin, device_pages, host_pages, disk_len, slabs).
ANSWERS = [
    (1, np.arange(5, dtype=np.int64), np.empty(0, dtype=np.int64), 0, 0),
    (127, np.arange(64, dtype=np.int64), np.arange(64, 128, dtype=np.int64), 127, 128),
    (128, np.array([2**31 + 5, -1, 2**40], dtype=np.int64), np.arange(3, dtype=np.int32), 255, 256),
    (2**16, np.arange(70000, dtype=np.int64), np.arange(10, dtype=np.int16), 65535, 65536),
    (2**32, np.arange(16, dtype=np.int64)[::2], np.arange(3, dtype=np.uint8), -1, -33),
    (2**63 - 1, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), -129, -(2**31) - 1),
    (5, np.arange(3, dtype=np.int64), np.arange(2, dtype=np.int64), -(2**15) - 1, 2**32 + 1),
]
IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


def as_dict(answer: tuple) -> dict:
    pin, dev, host, disk_len, slabs = answer
    return {"pin": pin, "device_pages": dev.astype("<i4").tobytes(), "host_pages": host.astype("<i4").tobytes(),
            "disk_len": disk_len, "slabs": slabs}


@needs_native
def test_fast_replies_are_the_packers_bytes(tmp_path):
    calls = {"python": 0, "fast": 0}
    current: dict = {}

    def match(conn, p):
        calls["python"] += 1
        return as_dict(current["answer"])

    def fast_match(conn, engine, keys):
        if engine == 99:  # declined: the Python handler answers
            return None
        if engine == 98:
            raise ValueError("a bug")
        calls["fast"] += 1
        return current["answer"]

    def release(conn, p):
        calls["python"] += 1
        return True

    def fast_release(conn, pin, _):
        calls["fast"] += 1
        return True

    match.fast, release.fast = fast_match, fast_release
    path = str(tmp_path / "s.sock")
    with serving(path, native=True) as (server, _):
        server.handlers.update({"match": match, "release": release})
        assert server.frame_loop == "native"
        s = raw(path)
        for i, answer in enumerate(ANSWERS):
            current["answer"] = answer
            req_id = IDS[i]
            if i == 0:  # before hello: the Python path refuses it
                s.sendall(pack_frame({"id": req_id, "method": "match", "params": {"engine": 1, "keys": b""}}))
                assert msgpack.unpackb(recv_raw(s))["error"]["code"] == "HELLO_REQUIRED"
                s.sendall(pack_frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
                recv_raw(s)
            for rid in (req_id, IDS[-1 - i]):
                s.sendall(pack_frame({"id": rid, "method": "match", "params": {"engine": 1, "keys": b"k" * 16}}))
                assert recv_raw(s) == pack_frame({"id": rid, "result": as_dict(answer)})[4:]
        before = dict(calls)
        s.sendall(pack_frame({"id": 7, "method": "release", "params": {"pin": 3}}))
        assert recv_raw(s) == pack_frame({"id": 7, "result": True})[4:]
        s.sendall(pack_frame({"id": 8, "method": "match", "params": {"engine": 99, "keys": b""}}))
        assert recv_raw(s) == pack_frame({"id": 8, "result": as_dict(current["answer"])})[4:]
        assert calls == {"python": before["python"] + 1, "fast": before["fast"] + 1}
        s.sendall(pack_frame({"id": 9, "method": "match", "params": {"engine": 98, "keys": b""}}))
        err = msgpack.unpackb(recv_raw(s))
        assert err["id"] == 9 and err["error"]["code"] == "INTERNAL"
        assert calls["python"] == before["python"] + 1
        assert server.counters.fast_requests == calls["fast"] and server.counters.requests > calls["fast"]
        s.close()
