"""The blocking connection's reads: frames split over many recvs or packed several to
one, frames larger than its buffer, and deadlines that hold over a whole exchange
although the socket's own timeout is only reset when it strays (connection.py).

The daemon's end is one side of a socketpair driven by a thread, so each test can
shape the bytes exactly.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

import msgpack
import pytest

from hicache.client.connection import MAX_FRAME_BYTES, RECV_CHUNK, RpcConnection
from hicache.errors import ClientError, DaemonSlow, DaemonUnavailable
from hicache.rpc.framing import HEADER, BlobRequest, FrameDecoder, pack_frame, unpack_body
from tests.wait import wait_until


class Peer:
    """Answers each request with whatever `answer(request)` returns (bytes to send, or a
    callable that sends them itself)."""

    def __init__(self, answer: Callable[[dict, socket.socket], None]) -> None:
        self.client_sock, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.answer = answer
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dec = FrameDecoder(64 << 20)
        try:
            while data := self.sock.recv(1 << 16):
                for body in dec.feed(data):
                    self.answer(unpack_body(body), self.sock)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv; close alone would not
        except OSError:
            pass
        self.sock.close()
        self.client_sock.close()
        self.thread.join(10)


def reply(req: dict, result: object) -> bytes:
    return pack_frame({"id": req["id"], "result": result})


@pytest.fixture
def peer_factory():
    peers: list[Peer] = []

    def make(answer: Callable[[dict, socket.socket], None]) -> Peer:
        peers.append(Peer(answer))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


def test_a_reply_sent_a_byte_at_a_time_is_read_whole(peer_factory):
    def answer(req: dict, s: socket.socket) -> None:
        for b in reply(req, {"echo": req["params"]["x"]}):
            s.sendall(bytes([b]))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    for i in range(3):
        assert conn.call("m", {"x": i}) == {"echo": i}


def test_events_and_a_stale_reply_in_one_write_with_the_answer(peer_factory):
    def answer(req: dict, s: socket.socket) -> None:
        s.sendall(pack_frame({"event": {"n": req["id"]}}) + pack_frame({"id": -1, "result": "stale"})
                  + reply(req, req["id"]) + pack_frame({"event": {"after": req["id"]}}))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    first = conn.call("m")
    assert conn.call("m") == first + 1  # the buffered event after the first answer did not shift the stream
    assert list(conn.events) == [{"n": first}, {"after": first}, {"n": first + 1}]
    events = [conn.read_event() for _ in range(4)]  # the last one still in the buffer, not lost
    assert events == [{"n": first}, {"after": first}, {"n": first + 1}, {"after": first + 1}]


def test_frames_larger_than_the_receive_buffer(peer_factory):
    big = bytes(range(256)) * ((3 * RECV_CHUNK) // 256)

    def answer(req: dict, s: socket.socket) -> None:
        s.sendall(reply(req, big if req["method"] == "big" else "small"))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    assert conn.call("small") == "small"
    assert conn.call("big") == big
    assert conn.call("small") == "small"
    for _ in range(8):  # frames that straddle the buffer's end get moved to its front
        assert conn.call("big") == big and conn.call("small") == "small"


def test_a_reply_trickled_past_the_deadline_costs_one_deadline(peer_factory):
    """A per-read timeout would wait as long as the daemon trickles (10 s here)."""
    stop = threading.Event()

    def answer(req: dict, s: socket.socket) -> None:
        frame = reply(req, "x" * 100)
        for i in range(len(frame)):
            if stop.wait(0.1):
                return
            s.sendall(frame[i:i + 1])
    peer = peer_factory(answer)
    conn = RpcConnection(peer.client_sock, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(DaemonSlow, match="no answer to m in 1s"):
        conn.call("m", timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0, "the deadline was not kept over the whole exchange"
    assert not conn.closed and conn.suspect  # a late answer is no lost connection
    stop.set()


def test_a_short_call_timeout_under_a_long_default(peer_factory):
    conn = RpcConnection(peer_factory(lambda req, s: None).client_sock, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        conn.call("m", timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0


def test_read_event_without_a_deadline_times_out_on_the_default(peer_factory):
    conn = RpcConnection(peer_factory(lambda req, s: None).client_sock, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        conn.read_event()
    assert time.monotonic() - t0 < 5.0


def test_a_peer_that_hangs_up_mid_frame(peer_factory):
    def answer(req: dict, s: socket.socket) -> None:
        s.sendall(reply(req, "y" * 1000)[:500])
        s.shutdown(socket.SHUT_WR)
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    with pytest.raises(DaemonUnavailable, match="closed the connection"):
        conn.call("m")
    assert conn.closed


def test_a_long_call_after_a_short_one_waits_its_own_deadline(peer_factory):
    """The socket's timeout stays at the short call's; the long call re-arms it when it
    runs out instead of failing early."""
    def answer(req: dict, s: socket.socket) -> None:
        if req["method"] == "slow":
            time.sleep(1.2)  # the daemon's side being slow (what is tested), not the test waiting
        s.sendall(reply(req, req["method"]))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    assert conn.call("fast", timeout_s=0.5) == "fast"  # room for a loaded machine's scheduling
    assert conn.call("slow", timeout_s=10.0) == "slow"
    assert conn.call("fast", timeout_s=0.5) == "fast"


def test_alternating_deadlines_set_no_socket_option(peer_factory, monkeypatch):
    conn = RpcConnection(peer_factory(lambda req, s: s.sendall(reply(req, 1))).client_sock, timeout_s=10)
    sets: list[float] = []
    real = conn._reader.set_so_timeout
    monkeypatch.setattr(conn._reader, "set_so_timeout", lambda seconds: (sets.append(seconds), real(seconds)))
    for _ in range(50):
        assert conn.call("match", timeout_s=0.25) == 1
        assert conn.call("release", timeout_s=0.5) == 1
    assert len(sets) == 1, sets  # lowered once to the shortest deadline, then left alone


# -- one whole answer per recv (`_quick_read`) and what it hands to the general path ------
def test_a_spliced_request_carries_its_params_and_gets_its_answer(peer_factory):
    seen: list[dict] = []

    def answer(req: dict, s: socket.socket) -> None:
        seen.append(req)
        s.sendall(reply(req, {"n": len(req["params"]["keys"])}))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    match = BlobRequest("match", {"engine": 3}, "keys")
    for blob in (b"", b"k" * 16, bytes(8192)):
        assert conn.call_blob(match, blob) == {"n": len(blob)}
    assert [r["params"] for r in seen] == [{"engine": 3, "keys": b""}, {"engine": 3, "keys": b"k" * 16},
                                           {"engine": 3, "keys": bytes(8192)}]
    assert [r["id"] for r in seen] == [1, 2, 3] and {r["method"] for r in seen} == {"match"}


def test_a_whole_frame_not_ours_read_first_is_settled_then_ours_read(peer_factory):
    """A stale answer and an event, each alone in the socket before the call: the first
    recv holds one whole frame that is not the answer (the answer is sent only once the
    client has read it)."""
    def readable() -> bool:
        return bool(select.select([peer.client_sock], [], [], 0)[0])

    def answer(req: dict, s: socket.socket) -> None:
        if req["method"] == "push":  # what the next call finds waiting
            s.sendall(pack_frame({"id": 10**6, "result": "stale"}) if req["params"]["stale"]
                      else pack_frame({"event": {"e": 1}}))
        else:
            wait_until(lambda: not readable(), what="the client's read of the pushed frame")
            s.sendall(reply(req, "mine"))
    peer = peer_factory(answer)
    conn = RpcConnection(peer.client_sock, timeout_s=10)
    for stale in (True, False):
        conn._send_frame(pack_frame({"id": 0, "method": "push", "params": {"stale": stale}}))
        wait_until(readable, what="the pushed frame")
        assert conn.call("m") == "mine"
    assert list(conn.events) == [{"e": 1}]


def test_a_refusal_read_whole_raises_and_keeps_the_connection(peer_factory):
    def answer(req: dict, s: socket.socket) -> None:
        s.sendall(pack_frame({"id": req["id"], "error": {"code": "BAD", "message": "no"}})
                  if req["method"] == "bad" else reply(req, "ok"))
    conn = RpcConnection(peer_factory(answer).client_sock, timeout_s=10)
    with pytest.raises(ClientError, match="no") as e:
        conn.call_blob(BlobRequest("bad", {}, "keys"), b"x")
    assert e.value.code == "BAD" and not conn.closed
    assert conn.call("ok") == "ok"


@pytest.mark.parametrize("frame", [
    HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",  # whole, but not msgpack
    HEADER.pack(3) + msgpack.packb([1, 2]),    # whole, but not a map
    HEADER.pack(MAX_FRAME_BYTES + 1) + b"x",   # a length over the cap
], ids=["garbled", "not-a-map", "oversized"])
def test_a_broken_answer_drops_the_connection(peer_factory, frame):
    conn = RpcConnection(peer_factory(lambda req, s: s.sendall(frame)).client_sock, timeout_s=10)
    with pytest.raises(DaemonUnavailable, match="receive failed"):
        conn.call_blob(BlobRequest("match", {"engine": 1}, "keys"), b"k" * 16)
    assert conn.closed
    with pytest.raises(DaemonUnavailable, match="connection closed"):
        conn.call("m")
