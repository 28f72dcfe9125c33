"""A slow answer is a miss, never a lost connection (issue 41): the connection keeps its
place in the stream past any deadline, hands a late answer to its call's handler, posts
what the handler gives back, and ends only when the daemon answers no liveness probe,
closes, or reads nothing of what is queued for it.

The daemon's end is one side of a socketpair driven by a thread (tests/client/
test_connection_reads.py's Peer), so each test can hold, cut and reorder answers.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

import hicache.client.socket_io as socket_io
from hicache.client.connection import RpcConnection
from hicache.errors import DaemonSlow, DaemonUnavailable
from hicache.rpc.framing import FrameDecoder, pack_frame, unpack_body
from tests.client.test_connection_reads import Peer, reply
from tests.wait import wait_until


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(answer) -> Peer:
        made.append(Peer(answer))
        return made[-1]
    yield make
    for p in made:
        p.close()


class Holding:
    """Answers `sync` at once and everything else only when `release` is set; records
    every request it reads."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[dict] = []

    def __call__(self, req: dict, s: socket.socket) -> None:
        self.seen.append(req)
        if req.get("noreply"):
            return
        if req["method"] != "sync":
            self.release.wait(30)
        s.sendall(reply(req, {"pin": 7} if req["method"] == "match" else True))


def test_a_late_answer_goes_to_its_handler_whose_undo_is_posted(peers):
    peer = Holding()
    conn = RpcConnection(peers(peer).client_sock, timeout_s=10)
    late: list[object] = []

    def undo(outcome: object) -> list[tuple[str, dict]]:
        late.append(outcome)
        return [("release", {"pin": outcome["pin"]})]  # type: ignore[index]
    with pytest.raises(DaemonSlow):
        conn.call("match", {"keys": b""}, timeout_s=0.2, on_late=undo)
    assert not conn.closed and conn.suspect and conn.given_up == 1
    peer.release.set()  # the daemon answers the match, then the probe sent after it
    wait_until(lambda: conn.poll() or not conn.suspect, 30, "the probe's answer")
    assert late == [{"pin": 7}] and conn.late_answers == 1
    wait_until(lambda: any(r["method"] == "release" for r in peer.seen), 30, "the posted release")
    release = next(r for r in peer.seen if r["method"] == "release")
    assert release["params"] == {"pin": 7} and release["noreply"] is True
    assert [r["method"] for r in peer.seen] == ["match", "sync", "release"]
    assert conn.call("other") is True  # the same connection, in step


def test_a_frame_cut_at_the_deadline_is_read_whole_later(peers):
    go_on = threading.Event()
    big = "x" * 300_000  # larger than the receive buffer too

    def answer(req: dict, s: socket.socket) -> None:
        if req["method"] == "sync":
            s.sendall(reply(req, True))
            return
        frame = reply(req, big)
        s.sendall(frame[:1000])
        go_on.wait(30)
        s.sendall(frame[1000:])
    conn = RpcConnection(peers(answer).client_sock, timeout_s=10)
    got: list[object] = []
    with pytest.raises(DaemonSlow):
        conn.call("m", timeout_s=0.3, on_late=lambda r: got.append(r) or None)
    go_on.set()
    wait_until(lambda: conn.poll() or got, 30, "the rest of the frame")
    assert got == [big]
    assert conn.call("n") == big  # the stream is still in step


def test_a_daemon_that_answers_no_probe_in_liveness_s_is_dead(peers):
    conn = RpcConnection(peers(lambda req, s: None).client_sock, timeout_s=10, liveness_s=0.3)
    with pytest.raises(DaemonSlow):
        conn.call("m", timeout_s=0.1)
    assert not conn.closed
    with pytest.raises(DaemonUnavailable, match="liveness probe"):
        wait_until(lambda: conn.poll() and False, 30, "the connection's end")
    assert conn.closed


def test_sent_calls_are_answered_out_of_order_and_polled_without_waiting(peers):
    held: list[tuple[dict, socket.socket]] = []

    def answer(req: dict, s: socket.socket) -> None:
        held.append((req, s))
        if len(held) == 3:  # answer the three in reverse order
            for r, sock in reversed(held):
                sock.sendall(reply(r, r["params"]["n"]))
    conn = RpcConnection(peers(answer).client_sock, timeout_s=10)
    pending = [conn.send("m", {"n": i}) for i in range(3)]
    t0 = time.monotonic()
    conn.poll()
    assert time.monotonic() - t0 < 5.0  # hang guard: poll never waits
    wait_until(lambda: conn.poll() or all(p.done for p in pending), 30, "the answers")
    assert [p.outcome for p in pending] == [0, 1, 2]


def test_an_overdue_sent_call_starts_a_probe_and_stays(peers):
    """As the daemon's async handlers (a `load` waiting for the disk) do: the call is answered
    after the probe sent behind it."""
    held: list[tuple[dict, socket.socket]] = []

    def answer(req: dict, s: socket.socket) -> None:
        if req["method"] == "sync":
            s.sendall(reply(req, True))
        else:
            held.append((req, s))
    conn = RpcConnection(peers(answer).client_sock, timeout_s=10)
    p = conn.send("m", timeout_s=0.05)
    wait_until(lambda: conn.poll() or conn.suspect, 30, "a probe for the overdue call")
    wait_until(lambda: conn.poll() or not conn.suspect, 30, "the probe's answer")
    assert not p.done and not conn.closed
    req, sock = held[0]
    sock.sendall(reply(req, "late"))
    wait_until(lambda: conn.poll() or p.done, 30, "the overdue answer")
    assert p.outcome == "late"


def test_sends_never_block_on_a_daemon_that_does_not_read(monkeypatch):
    client_sock, daemon_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = RpcConnection(client_sock, timeout_s=10)
        payload = {"blob": b"z" * 4096}
        t0 = time.monotonic()
        for _ in range(200):  # ~800 KiB: several socket buffers
            conn.post("put_done", payload)
        assert time.monotonic() - t0 < 10.0  # hang guard: no post waited for the reader
        assert conn.unsent  # the rest waits, in order, for the daemon to read
        dec, frames = FrameDecoder(1 << 20), []
        daemon_sock.settimeout(10)
        while sum(f["method"] == "put_done" for f in frames) < 200:
            conn.poll()  # each operation sends what the socket takes
            frames += [unpack_body(b) for b in dec.feed(daemon_sock.recv(1 << 16))]
        ids = [f["id"] for f in frames]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)  # all of them, in order
        assert {f["method"] for f in frames} == {"put_done", "sync"}  # a sync settles the posts
        # a daemon that reads nothing of MAX_OUTBOX_BYTES queued for it is dead
        monkeypatch.setattr(socket_io, "MAX_OUTBOX_BYTES", 64 << 10)
        with pytest.raises(DaemonUnavailable, match="read nothing"):
            for _ in range(200):
                conn.post("put_done", payload)
        assert conn.closed
    finally:
        daemon_sock.close()
        client_sock.close()


def test_a_noreply_frame_is_posted_with_its_flag():
    client_sock, daemon_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = RpcConnection(client_sock, timeout_s=10)
        conn.post_many([("release", {"pin": 1}), ("release", {"pin": 2})])
        daemon_sock.settimeout(10)
        data = b""
        expected = pack_frame({"id": 1, "method": "release", "params": {"pin": 1}, "noreply": True})
        while len(data) < 2 * len(expected):
            data += daemon_sock.recv(1 << 16)
        msgs = list(FrameDecoder(1 << 20).feed(data))
        assert [unpack_body(m)["params"]["pin"] for m in msgs] == [1, 2]
    finally:
        daemon_sock.close()
        client_sock.close()


def test_an_idle_engine_waits_for_an_answer_without_reading_it(peers):
    """wait_for_answers (the vLLM scheduler's empty steps): returns when an answer can be
    read, reads nothing itself, and does not wait when no answer is owed."""
    from types import SimpleNamespace

    from hicache.client.asks import wait_for_answers

    peer = Holding()
    conn = RpcConnection(peers(peer).client_sock, timeout_s=10)
    client = SimpleNamespace(conn=conn)
    assert not wait_for_answers([client], 30.0)  # nothing owed: at once
    p = conn.send("match", {"keys": b""})
    wait_until(lambda: peer.seen, 30)
    assert not wait_for_answers([client], 0.05)  # held: nothing came
    peer.release.set()
    assert wait_for_answers([client], 30.0)  # returns as the answer arrives
    assert not p.done  # not read: the next poll takes it
    conn.poll()
    assert p.done and p.outcome == {"pin": 7}
    assert not wait_for_answers([client, SimpleNamespace(conn=None)], 30.0)  # nothing owed any more
