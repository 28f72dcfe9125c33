"""The native frame loop's own contract (hicache/rpc/native_conn.py), in-process on a real
socket: a connection torn down mid-frame or mid-write leaves nothing behind (its
descriptor closed, once; nothing left watched or counted; the disconnect hook run once),
and without the extension the server serves on asyncio and says so."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hicache.rpc import native_conn
from hicache.rpc.framing import pack_frame
from hicache.rpc.server import RpcServer

from tests.rpc.wire import greet, hung_up, raw, request, wait_until

needs_native = pytest.mark.skipif(native_conn.load() is None and os.environ.get("CI") != "true",
                                  reason=f"native frame loop {native_conn.unavailable_reason()}")


@pytest.fixture(scope="module", autouse=True)
def _on_each_frame_loop():
    """These tests choose their frame loop themselves (overrides tests/rpc/conftest.py)."""


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


@contextmanager
def serving(path: str, native: bool | None, extra: dict | None = None,
            **limits: int) -> Iterator[tuple[RpcServer, Counter]]:
    """An RpcServer on its own loop thread; `big` answers 4 MiB, more than a socket holds."""
    lost: Counter = Counter()
    handlers = {"hello": lambda conn, p: {"version": 1}, "ping": lambda conn, p: "pong",
                "big": lambda conn, p: b"x" * (4 << 20), **(extra or {})}
    server = RpcServer(handlers, max_frame_bytes=16 << 20, max_buffer_bytes=32 << 20, max_inflight=16,
                       allowed_uids={os.getuid(), 0}, allowed_gids=set(),
                       on_disconnect=lambda conn: lost.update([id(conn)]), native=native, **limits)
    loop = new_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start(path=path))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ready.wait(30)
        yield server, lost
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(server.drain(1.0))
        loop.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_native
def test_connections_torn_down_mid_frame_or_mid_write_leave_nothing_behind(tmp_path):
    path = str(tmp_path / "s.sock")
    with serving(path, native=True) as (server, lost):
        assert server.frame_loop == "native"
        base = open_fds()
        socks = []
        for i in range(20):
            s = raw(path)
            greet(s)
            if i % 2:  # mid-frame: half of a frame's body, then gone
                s.sendall(struct.pack(">I", 1000) + b"y" * 500)
            else:  # mid-write: a reply larger than the socket holds, never read
                s.sendall(pack_frame({"id": 2, "method": "big", "params": {}}))
            socks.append(s)
        assert wait_until(lambda: len(server.connections) == 20 and server.buffered_bytes == 10 * 504, 10)
        for s in socks:
            s.close()
        assert wait_until(lambda: not server.connections and len(lost) == 20, 10), \
            f"{len(server.connections)} connections left, {len(lost)} disconnects"
        assert max(lost.values()) == 1  # each connection's cleanup ran once
        assert server.buffered_bytes == 0
        assert wait_until(lambda: open_fds() == base, 10)  # each descriptor closed, the clients' and ours
        s = raw(path)  # and the loop still serves
        greet(s)
        assert request(s, 3, "ping")["result"] == "pong"
        s.close()


@needs_native
def test_an_oversized_frame_closes_only_that_connection(tmp_path):
    path = str(tmp_path / "s.sock")
    with serving(path, native=True) as (server, lost):
        bad, good = raw(path), raw(path)
        greet(bad)
        greet(good)
        bad.sendall(struct.pack(">I", (16 << 20) + 1))
        assert hung_up(bad, 10)
        assert request(good, 2, "ping")["result"] == "pong"
        assert wait_until(lambda: len(lost) == 1 and len(server.connections) == 1, 10)
        bad.close()
        good.close()


def test_without_the_extension_the_server_serves_on_asyncio(tmp_path, monkeypatch):
    """(Where the module was not built, tests/kernels/test_native_build.py.)"""
    monkeypatch.setattr(native_conn.EXTENSION, "_loaded", [])
    monkeypatch.setenv("HICACHE_NATIVE_RPC", "0")
    assert native_conn.load() is None
    assert native_conn.unavailable_reason() == "disabled by HICACHE_NATIVE_RPC=0"
    path = str(tmp_path / "s.sock")
    with serving(path, native=None) as (server, _):
        assert server.frame_loop == "asyncio"
        s = raw(path)
        greet(s)
        assert request(s, 2, "ping")["result"] == "pong"
        s.close()
    loop = new_loop()
    required = RpcServer({}, max_frame_bytes=1 << 20, max_buffer_bytes=1 << 20, max_inflight=1,
                         allowed_uids={os.getuid()}, allowed_gids=set(), on_disconnect=lambda conn: None,
                         native=True)
    with pytest.raises(RuntimeError, match="native frame loop"):
        loop.run_until_complete(required.start(path=str(tmp_path / "x.sock")))
    loop.close()
    assert not (tmp_path / "x.sock").exists()


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False], ids=["native", "asyncio"])
def test_a_burst_of_slow_frames_gives_way_to_another_connection_after_a_turn(tmp_path, native):
    """A connection's frames run for at most TURN_S a loop turn (FRAMES_PER_TURN was the only
    limit: 64 frames of 20-45 ms of put_done held another engine's match as long)."""
    path = str(tmp_path / "s.sock")
    order: list[object] = []
    sent = threading.Event()

    def slow(conn, p):  # a handler's work, holding the loop; the first waits for the other's frame
        if p["i"] == 0:
            assert sent.wait(30)
        end = time.perf_counter() + 0.003
        while time.perf_counter() < end:
            pass
        order.append(p["i"])

    def other(conn, p):
        order.append("other")
        return "pong"

    with serving(path, native, {"slow": slow, "other": other}):
        a, b = raw(path), raw(path)
        greet(a)
        greet(b)
        a.sendall(b"".join(pack_frame({"id": i + 1, "method": "slow", "params": {"i": i}}) for i in range(40)))
        b.sendall(pack_frame({"id": 7, "method": "other", "params": {}}))
        sent.set()
        assert wait_until(lambda: len(order) == 41, 30)
        a.close()
        b.close()
    # 40 x 3 ms would have run first; a turn ends after 2 ms, so the other frame came within two
    assert order.index("other") <= 2, order
