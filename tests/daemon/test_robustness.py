"""Bad input gets a clear error, changes nothing, and the daemon keeps serving."""

from __future__ import annotations

import struct
import time

import msgpack
import numpy as np
import pytest

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.errors import ClientError
from hicache.index.keys import page_keys
from hicache.layout import KVLayout
from hicache.rpc.framing import ids_to_bytes, pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION
from tests.rpc.wire import raw, recv_frame

# Each test runs on both of the daemon's frame loops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("frame_loop")

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8)


def body_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def register(conn: RpcConnection, device_pages: int = 64, model: str = "m") -> dict:
    return conn.call("register", {"model": model, "layout": LAYOUT.to_dict(), "device_pages": device_pages})


def stats(path: str) -> dict:
    conn = RpcConnection.connect(path)
    conn.hello()
    try:
        return conn.call("stats")
    finally:
        conn.close()


def state_of(st: dict) -> tuple:
    return (st["pins"], st["pending_backups"], st["tiers"]["host"]["used_bytes"], st["tiers"]["device"]["pages"],
            st["requests"]["inserted_pages"], len(st["engines"]))


def test_malformed_frames_get_errors_and_the_connection_survives(daemon):
    s = raw(daemon.socket)
    s.sendall(pack_frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
    assert "result" in recv_frame(s)
    s.sendall(body_frame(b"\xc1\xc1garbage"))  # 0xc1 is never valid msgpack
    assert recv_frame(s)["error"]["code"] == "BAD_REQUEST"
    s.sendall(body_frame(msgpack.packb([1, 2, 3])))  # not a map
    assert recv_frame(s)["error"]["code"] == "BAD_REQUEST"
    s.sendall(pack_frame({"id": "x", "method": "stats"}))
    assert recv_frame(s)["error"]["code"] == "BAD_REQUEST"
    s.sendall(pack_frame({"id": 7, "method": "no_such_method", "params": {}}))
    r = recv_frame(s)
    assert r["id"] == 7 and r["error"]["code"] == "UNKNOWN_METHOD"
    s.sendall(pack_frame({"id": 8, "method": "stats", "params": []}))
    assert recv_frame(s)["error"]["code"] == "BAD_REQUEST"
    s.sendall(pack_frame({"id": 9, "method": "stats", "params": {}}))
    assert recv_frame(s)["id"] == 9  # still serving on the same connection
    s.close()


def test_oversized_frame_closes_only_that_connection(daemon):
    s = raw(daemon.socket)
    s.sendall(struct.pack(">I", 1 << 31) + b"x" * 16)
    with pytest.raises((ConnectionResetError, OSError)):
        recv_frame(s)
    assert stats(daemon.socket)["connections"] >= 1  # others are served


@pytest.mark.parametrize("method,params,code", [
    ("hello", {"version": 999}, "VERSION"),
    ("register", {"model": "m", "layout": "not a map", "device_pages": 8}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": {"kind": "mha"}, "device_pages": 8}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": {**LAYOUT.to_dict(), "dtype": "int4"}, "device_pages": 8}, "BAD_PARAMS"),
    ("register", {"model": 5, "layout": LAYOUT.to_dict(), "device_pages": 8}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 0}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 8, "tp_rank": 3}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 8, "store_pages": -1}, "BAD_PARAMS"),
    ("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 8, "store_pages": "128"}, "BAD_PARAMS"),
    ("match", {"engine": 12345, "keys": b""}, "NOT_REGISTERED"),
    ("match", {"engine": "ENGINE", "keys": b""}, "BAD_PARAMS"),
    ("match", {"engine": True, "keys": b""}, "BAD_PARAMS"),
    ("match", {"keys": b""}, "BAD_PARAMS"),
    ("match", {"engine": 12345, "keys": bytes(17)}, "BAD_PARAMS"),  # not whole 16-byte keys
    ("match", {"engine": 12345, "keys": "00" * 16}, "BAD_PARAMS"),
    ("release", {"pin": 999}, "NOT_FOUND"),
    ("release", {"pin": "1"}, "BAD_PARAMS"),
    ("release", {"pin": True}, "BAD_PARAMS"),
    ("release", {}, "BAD_PARAMS"),
    ("backup_done", {"backup": 999}, "NOT_FOUND"),
    ("load_done", {"pin": 1, "device_pages": b"abc"}, "BAD_PARAMS"),
    ("load_done", {"pin": 1, "device_pages": b"", "reclaim": "yes"}, "BAD_PARAMS"),
    ("flush", {"tier": "gpu"}, "BAD_PARAMS"),
    ("evict_tier", {"tier": "host", "bytes": -1}, "BAD_PARAMS"),
])
def test_bad_requests_are_refused(daemon, method, params, code):
    conn = RpcConnection.connect(daemon.socket)
    conn.hello()
    before = state_of(conn.call("stats"))
    with pytest.raises(ClientError) as err:
        conn.call(method, params)
    assert err.value.code == code, err.value
    assert state_of(conn.call("stats")) == before
    conn.close()


def test_engine_calls_validate_before_changing_anything(daemon):
    conn = RpcConnection.connect(daemon.socket)
    conn.hello()
    engine = register(conn, device_pages=16)["engine"]
    salt = conn.call("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 16})["salt"]
    tokens = np.arange(32, dtype=np.int32)
    keys = b"".join(page_keys(salt, tokens, 4))
    before = state_of(conn.call("stats"))
    bad = [
        {"engine": engine, "keys": keys[:-1], "tokens": tokens.tobytes(), "device_pages": ids_to_bytes(range(1, 9))},
        {"engine": engine, "keys": keys, "tokens": tokens[:-4].tobytes(), "device_pages": ids_to_bytes(range(1, 9))},
        {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": ids_to_bytes(range(1, 8))},
        {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": ids_to_bytes(range(10, 18))},
        {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": ids_to_bytes([0] + list(range(1, 8)))},
        {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": ids_to_bytes([1] * 8)},
        {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": ids_to_bytes(range(1, 9)), "pin": 4242},
    ]
    for params in bad:
        with pytest.raises(ClientError) as err:
            conn.call("insert", params)
        assert err.value.code in ("BAD_PARAMS", "NOT_FOUND")
        assert state_of(conn.call("stats")) == before
    # the good one still works afterwards, and a double release is refused
    r = conn.call("insert", {"engine": engine, "keys": keys, "tokens": tokens.tobytes(),
                             "device_pages": ids_to_bytes(range(1, 9))})
    assert r["present_pages"] == 0
    m = conn.call("match", {"engine": engine, "keys": keys})
    assert len(m["device_pages"]) == 8 * 4
    conn.call("release", {"pin": m["pin"]})
    with pytest.raises(ClientError) as err:
        conn.call("release", {"pin": m["pin"]})
    assert err.value.code == "NOT_FOUND"
    conn.close()


def test_another_connection_cannot_touch_my_pins_or_engine(daemon):
    a = RpcConnection.connect(daemon.socket)
    a.hello()
    reg = register(a)
    m = a.call("match", {"engine": reg["engine"], "keys": b""})
    b = RpcConnection.connect(daemon.socket)
    b.hello()
    for method, params in (("release", {"pin": m["pin"]}), ("match", {"engine": reg["engine"], "keys": b""}),
                           ("evict", {"engine": reg["engine"], "num_pages": 1})):
        with pytest.raises(ClientError) as err:
            b.call(method, params)
        assert err.value.code in ("NOT_FOUND", "NOT_REGISTERED")
    a.call("release", {"pin": m["pin"]})
    a.close()
    b.close()


def test_busy_beyond_the_inflight_cap(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk", env={"HICACHE_MAX_INFLIGHT": "1"}).start()
    conn = RpcConnection.connect(d.socket)
    conn.hello()
    reg = register(conn)
    pin = conn.call("match", {"engine": reg["engine"], "keys": b""})["pin"]
    s = conn.sock
    # two asynchronous requests in one write: the second finds the first in flight
    s.sendall(pack_frame({"id": 100, "method": "load", "params": {"pin": pin}}) +
              pack_frame({"id": 101, "method": "load", "params": {"pin": pin}}))
    answers = {}
    while len(answers) < 2:
        msg = recv_frame(s)
        answers[msg["id"]] = msg
    assert "result" in answers[100]
    assert answers[101]["error"]["code"] == "BUSY"
    conn.close()


def test_client_that_vanishes_mid_cycle_gives_everything_back(daemon):
    before = state_of(stats(daemon.socket))
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket)
    assert client.connect()
    tokens = np.arange(64, dtype=np.int32)
    reply = client.insert(tokens, np.arange(1, 17, dtype=np.int64))
    assert reply is not None and reply.backup is not None  # write-through plan, host pages reserved
    m = client.match(tokens)  # pins
    assert m.device_len == 16
    mid = stats(daemon.socket)
    assert mid["pins"] == 1 and mid["pending_backups"] == 1 and mid["tiers"]["host"]["used_bytes"] > 0
    client.conn.sock.close()  # vanish without a word
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = stats(daemon.socket)
        if after["pins"] == 0 and not after["engines"]:
            break
        time.sleep(0.05)
    assert after["pins"] == 0 and after["pending_backups"] == 0
    assert after["tiers"]["host"]["used_bytes"] == before[2]  # the planned backup's host pages came back
    assert after["tiers"]["device"]["pages"] == 0  # its device residency is forgotten
