"""The native echo servers of `hicache bench rpc --servers`: each answers hicache frames
exactly (whole, split across reads, several in one read, larger than a socket buffer),
a Python handler behind the C frame loop runs on the loop's thread, and without the
extension the bench says the server is unavailable instead of failing."""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hicache.bench.rpc import native_echo, rpc_bench
from hicache.client.connection import RpcConnection
from hicache.rpc.framing import pack_frame, unpack_body
from tests.wait import wait_until

# Skipped without a compiler or Python's headers, except under CI=true, where they must run.
needs_native = pytest.mark.skipif(native_echo.load() is None and os.environ.get("CI") != "true",
                                  reason=f"native echo servers {native_echo.unavailable_reason()}")


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def exchange(sock: socket.socket, data: bytes, reply_bytes: int, timeout_s: float = 60) -> bytes:
    """Send `data` while reading replies (a server that stops reading while its reply is
    pending would otherwise deadlock a plain sendall); `reply_bytes` of them."""
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    sent, got = 0, bytearray()
    try:
        while len(got) < reply_bytes:
            ready = sel.select(timeout_s)
            assert ready, f"no progress in {timeout_s}s (sent {sent}/{len(data)}, got {len(got)}/{reply_bytes})"
            for _, mask in ready:
                if mask & selectors.EVENT_WRITE:
                    sent += sock.send(data[sent:sent + (1 << 20)])
                    if sent == len(data):
                        sel.modify(sock, selectors.EVENT_READ)
                if mask & selectors.EVENT_READ:
                    chunk = sock.recv(1 << 20)
                    assert chunk, "the server closed the connection"
                    got += chunk
    finally:
        sel.close()
        sock.setblocking(True)
    return bytes(got)


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    return s


@contextmanager
def subprocess_server(tmp_path, server: str) -> Iterator[str]:
    """A server as the bench runs it: its own process."""
    path = str(tmp_path / f"{server}.sock")
    proc = rpc_bench._start_native(path, server)
    try:
        rpc_bench._wait_socket(path, proc)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def loop_thread_server(tmp_path, handler) -> Iterator[tuple[str, list]]:
    """A NativeFrameServer on a uvloop loop in a thread of this process; yields its path and
    the contexts its loop's exception handler received."""
    import uvloop

    path, loop = str(tmp_path / "inproc.sock"), uvloop.new_event_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = native_echo.NativeFrameServer(loop, path, handler)
        ready.set()
        loop.run_forever()
        server.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(30), "the in-process server did not start"
        yield path, errors
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()


BYTE_ECHOES = ["native-epoll", "native-uvloop", "native-uvloop-py"]  # reply = request, byte for byte
SIZES = [0, 1, 3, 4, 100, 8192, 65531, 65532, 65536 + 7, 300_000]


@needs_native
@pytest.mark.parametrize("server", BYTE_ECHOES)
def test_each_native_server_echoes_frames_byte_for_byte(tmp_path, server):
    bodies = [os.urandom(n) for n in SIZES]
    with subprocess_server(tmp_path, server) as path, connect(path) as s:
        for body in bodies:  # one at a time
            assert exchange(s, frame(body), len(body) + 4) == frame(body)
        stream = b"".join(frame(b) for b in bodies)  # all in one send: several frames per read
        assert exchange(s, stream, len(stream)) == stream
        pieces = frame(b"abcdefgh" * 1000)  # split inside the header and the body
        for a, b in [(0, 1), (1, 3), (3, 4), (4, 5), (5, 4000), (4000, len(pieces))]:
            s.sendall(pieces[a:b])
        assert exchange(s, b"", len(pieces)) == pieces
        big = frame(os.urandom(5 << 20))  # far more than a socket buffer: split reads, pending replies
        assert exchange(s, big + frame(b"after"), len(big) + 9) == big + frame(b"after")


@needs_native
@pytest.mark.parametrize("server", [*BYTE_ECHOES, "native-uvloop-msgpack"])
def test_a_hicache_client_gets_its_answers_from_each_native_server(tmp_path, server):
    params = {"engine": 1, "keys": os.urandom(8192)}
    with subprocess_server(tmp_path, server) as path:
        conns = [RpcConnection.connect(path, timeout_s=30) for _ in range(3)]
        for _ in range(5):
            for c in conns:  # the byte echoes send the request back: right id, no result
                assert c.call("echo", params) == (params if server == "native-uvloop-msgpack" else None)
        for c in conns:
            c.close()


@needs_native
@pytest.mark.parametrize("server", ["native-epoll", "native-uvloop"])
def test_an_oversized_frame_closes_only_its_connection(tmp_path, server):
    with subprocess_server(tmp_path, server) as path, connect(path) as bad, connect(path) as good:
        bad.sendall(struct.pack(">I", native_echo.MAX_FRAME_BYTES + 1))
        assert bad.recv(16) == b""
        assert exchange(good, frame(b"still here"), 14) == frame(b"still here")


@needs_native
def test_a_python_handler_runs_on_the_loop_thread_and_its_answer_is_framed(tmp_path):
    threads: set[int] = set()

    def handler(body: bytes) -> bytes | None:
        threads.add(threading.get_ident())
        if body == b"boom":
            raise ValueError("a handler fault")
        return None if body == b"posted" else body[::-1]

    with loop_thread_server(tmp_path, handler) as (path, errors):
        with connect(path) as s:
            stream = frame(b"abc") + frame(b"posted") + frame(os.urandom(100_000)) + frame(b"xyz")
            body3 = stream[4 + 3 + 4 + 6 + 4:4 + 3 + 4 + 6 + 4 + 100_000]
            want = frame(b"cba") + frame(body3[::-1]) + frame(b"zyx")  # nothing for the posted frame
            assert exchange(s, stream, len(want)) == want
            s.sendall(frame(b"boom"))
            assert s.recv(16) == b""  # a handler that raises closes its connection ...
        wait_until(lambda: errors, what="the loop's exception handler hearing of the fault")
        assert isinstance(errors[0]["exception"], ValueError)
        with connect(path) as s:  # ... and the server goes on
            assert exchange(s, frame(b"ok"), 6) == frame(b"ko")
    assert len(threads) == 1 and threading.get_ident() not in threads


@needs_native
def test_the_msgpack_handler_answers_as_the_python_echo_server(tmp_path):
    with loop_thread_server(tmp_path, native_echo.msgpack_echo_handler()) as (path, _), connect(path) as s:
        req = pack_frame({"id": 7, "method": "echo", "params": {"keys": b"\x01" * 64}})
        want = pack_frame({"id": 7, "result": {"keys": b"\x01" * 64}})
        reply = exchange(s, req, len(want))
        assert reply == want and unpack_body(reply[4:])["result"] == {"keys": b"\x01" * 64}


def test_without_the_extension_nothing_is_served_and_the_reason_is_given(tmp_path, monkeypatch):
    """(Where the module was not built, tests/kernels/test_native_build.py.)"""
    monkeypatch.setattr(native_echo.EXTENSION, "_loaded", [])
    monkeypatch.setenv("HICACHE_NATIVE_ECHO", "0")
    assert native_echo.load() is None
    assert native_echo.unavailable_reason() == "disabled by HICACHE_NATIVE_ECHO=0"
    with pytest.raises(RuntimeError, match="native echo server"):
        native_echo.serve(str(tmp_path / "x.sock"), "epoll")
    assert not (tmp_path / "x.sock").exists()


def test_the_bench_reports_an_unavailable_native_server_and_the_rest(monkeypatch):
    monkeypatch.setattr(native_echo.EXTENSION, "_loaded", [])
    monkeypatch.setenv("HICACHE_NATIVE_ECHO", "0")
    rows = rpc_bench.run(prompt_tokens=64, requests=100, client_counts=(1,), repeats=1, calls=("match",),
                         servers=("native-epoll", "native-uvloop-py"))
    gone = [r for r in rows if r.get("note", "").startswith("unavailable")]
    assert [r["name"] for r in gone] == ["native-epoll server", "native-uvloop-py server"]
    assert all("HICACHE_NATIVE_ECHO=0" in r["note"] for r in gone)
    assert any(r["name"] == "match 64 tokens, 1 client p50" and r["value"] > 0 for r in rows)


@needs_native
def test_the_bench_times_each_native_server_against_redis_and_the_python_echo():
    rows = rpc_bench.run(prompt_tokens=64, requests=100, client_counts=(1,), repeats=1, calls=("match",),
                         servers=rpc_bench.NATIVE_SERVERS)
    by_name = {r["name"]: r for r in rows}
    for server in ["echo", *rpc_bench.NATIVE_SERVERS]:
        for q in (50, 99):
            r = by_name[f"match 64 tokens, 1 client {server} server p{q}"]
            assert r["value"] > 0 and r["baseline"] > 0 and r["vs_echo"] > 0
            assert r["baseline_name"] == ("redis" if any("redis" in n for n in by_name) else "echo")
            raw = by_name[f"match 64 tokens, 1 client {server} server, raw client p{q}"]
            assert raw["value"] > 0 and raw["baseline"] == r["baseline"]
        # the clients' own CPU per round trip: the hicache client's against the raw one's
        own = by_name[f"match 64 tokens, 1 client {server} server, hicache client CPU per call"]
        assert own["value"] > 0 and own["baseline"] > 0 and own["baseline_name"] == "raw client"


def test_an_unknown_server_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="unknown servers"):
        rpc_bench.run(servers=("native-nope",))
    with pytest.raises(ValueError, match="unknown native echo variant"):
        native_echo.serve("/nonexistent/x.sock", "nope")
