"""Slow, non-reading and half-open clients must cost the daemon nothing but their own connection.

While a client that floods requests and never reads, one that sent half a frame,
one that shut its write side and one that never said anything are all connected,
a well-behaved client is served within a generous deadline and SIGTERM stops the
daemon. A subscriber that never reads its events is dropped rather than buffered
without end.
"""

from __future__ import annotations

import signal
import socket
import time

import numpy as np
import pytest

from hicache.layout import KVLayout
from hicache.rpc.protocol import PROTOCOL_VERSION

from tests.robustness.contracts import small_event_backlog_env
from tests.robustness.proc import memory_kib, wait_exit
from tests.robustness.wire import HEADER, RawConn, WireEngine, WireError, frame, served_stats

# Each test runs on both of the daemon's frame loops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("frame_loop")

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8)
SERVED_WITHIN_S = 10.0  # generous for a loaded CI machine; a frozen event loop never answers
STOPS_WITHIN_S = 30.0  # the drain waits up to drain_timeout_s (10 s) for requests in flight


def flood_without_reading(path: str, max_s: float = 5.0, max_frames: int = 200_000) -> tuple[socket.socket, int]:
    """An engine that stored a page (so its namespace owns host memory), then asks for the
    descriptors of that memory (map_slabs) between `stats` requests,
    sent until the socket takes no more; it never reads a reply."""
    conn = RawConn(path, timeout_s=SERVED_WITHIN_S)
    conn.hello()
    eng = WireEngine(conn, LAYOUT, 64)
    eng.insert(np.arange(16, dtype=np.int32))
    s = conn.sock
    ask = frame({"id": 2, "method": "map_slabs", "params": {"engine": eng.engine_id}})
    ask += frame({"id": 3, "method": "hello", "params": {"version": PROTOCOL_VERSION}})
    req = ask + frame({"id": 4, "method": "stats", "params": {}}) * 64
    s.setblocking(False)
    sent, stuck_since, deadline = 0, None, time.monotonic() + max_s
    while time.monotonic() < deadline and sent < max_frames:
        try:
            s.send(req)
            sent += 66
            stuck_since = None
        except BlockingIOError:
            if stuck_since is None:
                stuck_since = time.monotonic()
            elif time.monotonic() - stuck_since > 0.5:  # both directions are full: it is flooded
                break
            time.sleep(0.005)
        except (BrokenPipeError, ConnectionResetError):
            break  # dropped by the daemon: allowed
    return s, sent


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(SERVED_WITHIN_S)  # a daemon that stopped reading shows up as a timeout, never a hang
    s.connect(path)
    return s


def half_frame(path: str, declared: int, sent: int) -> socket.socket:
    s = _connect(path)
    s.sendall(frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
    s.sendall(HEADER.pack(declared) + b"\x85" + b"\x00" * (sent - 1))
    return s


def half_closed(path: str) -> socket.socket:
    s = _connect(path)
    s.sendall(frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}})
              + b"".join(frame({"id": i, "method": "stats", "params": {}}) for i in range(2, 50)))
    s.shutdown(socket.SHUT_WR)
    return s


def idle(path: str) -> socket.socket:
    return _connect(path)


def test_stalled_clients_neither_stall_others_nor_block_sigterm(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    assert d.proc is not None
    held: list[socket.socket] = []
    flooded = 0
    try:
        try:
            held += [idle(d.socket), half_frame(d.socket, 1 << 20, 100), half_closed(d.socket)]
            flooder, flooded = flood_without_reading(d.socket)
            held.append(flooder)
            held += [half_frame(d.socket, 48 << 20, 4 << 20) for _ in range(4)]  # large frames, never finished
            held.append(idle(d.socket))
            st = served_stats(d.socket, SERVED_WITHIN_S)
        except (WireError, OSError) as e:
            raise AssertionError(f"with a client that sent {flooded} requests and reads nothing, a "
                                 f"half frame, a half-closed and idle clients connected: {e}") from None
        assert st["pid"] == d.proc.pid
        # an engine's cycle too, not just stats
        with RawConn(d.socket, timeout_s=SERVED_WITHIN_S) as c:
            c.hello()
            eng = WireEngine(c, LAYOUT, 64)
            tokens = np.arange(64, dtype=np.int32)
            eng.insert(tokens)
            m = eng.checked("match", {"engine": eng.engine_id, "keys": eng.keys(tokens)})
            assert len(m["device_pages"]) == 16 * 4, m
            eng.checked("release", {"pin": m["pin"]})
        rss = memory_kib(d.proc.pid)
        d.proc.send_signal(signal.SIGTERM)
        rc = wait_exit(d.proc, STOPS_WITHIN_S)
        assert rc is not None, (f"SIGTERM did not stop the daemon within {STOPS_WITHIN_S:.0f}s with stalled "
                                f"clients connected (RSS then {rss['VmRSS']} KiB)")
        assert rc == 0, f"the daemon exited {rc} on SIGTERM:\n{d.read_log()[-3000:]}"
    finally:
        for s in held:
            s.close()


def test_a_subscriber_that_never_reads_is_dropped(daemon_factory):
    """Events keep coming while a subscriber reads nothing: the daemon must drop it once it
    is over its output cap, not queue events for it without end (defect 6). Each evict of
    the engine's 4096 device pages sends every subscriber a `removed` event naming 4096
    16-byte keys (> 72 KiB), which bounds from below what was produced."""
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk", env=small_event_backlog_env()).start()
    assert d.proc is not None
    lazy = RawConn(d.socket, timeout_s=SERVED_WITHIN_S)
    lazy.hello()
    assert lazy.call("subscribe").get("result") is True
    lazy.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    produced = 0
    try:
        with RawConn(d.socket, timeout_s=SERVED_WITHIN_S) as c:
            c.hello()
            eng = WireEngine(c, LAYOUT, 4096)
            tokens = np.arange(4096 * 4, dtype=np.int32)
            eng.insert(tokens)  # host copies now exist: re-inserts below only move device residency
            while produced < 32 << 20:
                freed = eng.checked("evict", {"engine": eng.engine_id, "num_pages": 4096})["free_pages"]
                assert len(freed) == 4096 * 4, f"evict freed {len(freed) // 4} pages, not 4096"
                produced += 4096 * 18  # a msgpack bin8 per key
                eng.insert(tokens)
        rss = memory_kib(d.proc.pid)
        # Read what the daemon still holds for the lazy subscriber: a dropped one ends in EOF soon.
        got = 0
        lazy.sock.settimeout(1.0)
        read_until = time.monotonic() + 30
        while time.monotonic() < read_until:
            try:
                data = lazy.sock.recv(1 << 20)
            except (socket.timeout, ConnectionResetError):
                break
            if not data:
                break
            got += len(data)
    finally:
        lazy.close()
    assert got < 8 << 20, (f"a subscriber that read nothing while over {produced >> 20} MiB of events were "
                           f"produced was never dropped: {got >> 20} MiB were still queued for it "
                           f"(daemon RSS {rss['VmRSS'] >> 10} MiB, anon {rss['RssAnon'] >> 10} MiB)")
    served_stats(d.socket, SERVED_WITHIN_S)
