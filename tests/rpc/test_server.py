"""RpcServer in-process on a real socket, on each frame loop: one connection's burst of
frames is handled a bounded number per loop turn, so other connections are served in
between (defect 6); frames cut anywhere come back answered whole and in order, through a
pause for unread output and the resume once the client reads."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

from hicache.rpc.framing import pack_frame
from hicache.rpc.server import RpcServer

from tests.rpc.wire import greet, raw, recv_frame, request, wait_until


def busy(seconds: float) -> None:
    """Stands in for a handler's CPU work (an index walk), holding the loop as one would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_burst_on_one_connection_lets_another_in(tmp_path, frame_loop):
    order: list[str] = []
    handlers = {"hello": lambda conn, p: {"version": 1},
                "work": lambda conn, p: (busy(0.001), order.append("work"))[1],
                "ping": lambda conn, p: order.append("ping")}
    path = str(tmp_path / "s.sock")
    loop = asyncio.new_event_loop()
    server = RpcServer(handlers, max_frame_bytes=1 << 20, max_buffer_bytes=8 << 20, max_inflight=16,
                       allowed_uids={os.getuid(), 0}, allowed_gids=set(), on_disconnect=lambda conn: None,
                       native=frame_loop == "native")
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
        a, b = raw(path), raw(path)
        greet(a)
        greet(b)
        a.sendall(b"".join(pack_frame({"id": i, "method": "work", "params": {}}) for i in range(2000)))
        assert "result" in request(b, 1, "ping")
        # The defect: all 2000 (~2 s of work) ran in the callback that read them, ping after.
        assert order.index("ping") < 1000, f"ping waited behind {order.index('ping')} of another's frames"
        a.close()
        b.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_the_daemon_serves_on_the_frame_loop_asked_for(daemon, frame_loop):
    """HICACHE_NATIVE_RPC picks the daemon's frame loop, and its stats say which serves: the
    tests run on both only if a daemon asked for the C one is not quietly on asyncio."""
    s = raw(daemon.socket)
    greet(s)
    assert request(s, 1, "stats")["result"]["rpc"]["frame_loop"] == frame_loop
    s.close()


def test_frames_cut_anywhere_are_answered_whole_in_order_through_a_pause(tmp_path, frame_loop):
    handlers = {"hello": lambda conn, p: {"version": 1}, "echo": lambda conn, p: p["data"]}
    path = str(tmp_path / "s.sock")
    loop = asyncio.new_event_loop()
    server = RpcServer(handlers, max_frame_bytes=1 << 20, max_buffer_bytes=8 << 20, max_inflight=16,
                       allowed_uids={os.getuid(), 0}, allowed_gids=set(), on_disconnect=lambda conn: None,
                       native=frame_loop == "native")
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
        s = raw(path, timeout_s=60)
        greet(s)
        rng = random.Random(31)
        datas = [rng.randbytes(rng.choice([0, 1, 100, 5000, 30000])) for _ in range(600)]  # ~6 MB of replies
        stream = b"".join(pack_frame({"id": i, "method": "echo", "params": {"data": d}}) for i, d in enumerate(datas))
        cuts = sorted(rng.sample(range(1, len(stream)), 3000))

        def send() -> None:  # in pieces of 1 byte to ~10 KiB, without reading any reply
            for a, b in zip([0, *cuts], [*cuts, len(stream)]):
                s.sendall(stream[a:b])

        sender = threading.Thread(target=send)
        sender.start()
        # Unread replies pass the high-water mark: the server stops reading and serving it...
        assert wait_until(lambda: any(c._output_paused for c in list(server.connections)), 30)
        for i, d in enumerate(datas):  # ...and once read, serves the rest: all whole, in order
            assert recv_frame(s) == {"id": i, "result": d}
        sender.join(30)
        assert not sender.is_alive()
        assert server.counters.output_overflows == server.counters.input_overflows == 0
        s.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
