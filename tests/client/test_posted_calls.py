"""Calls sent without waiting for their answer (`wait=False`: a pin's release, a finished
put), against a real daemon: the daemon answers them only to refuse them, the next call
sees them done, a refusal is counted and logged when its answer is read, a hung daemon
costs the engine nothing and does not drop the connection, and unread answers stay
bounded."""

from __future__ import annotations

import logging
import signal

import numpy as np

from hicache.client.client import HiCacheClient, Match
from hicache.client.connection import MAX_POSTED
from hicache.layout import KVLayout
from hicache.rpc.framing import pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION
from tests.rpc.wire import raw, recv_frame
from tests.wait import wait_until

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)
PB = LAYOUT.page_bytes


def client(d) -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model="m", socket_path=d.socket, timeout_s=10.0)
    assert c.connect()
    return c


def stored(c: HiCacheClient, toks: np.ndarray) -> None:
    plan = c.put(toks)
    assert plan is not None and plan.put is not None
    assert c.arena is not None
    for slot in plan.host_pages:
        c.arena.array[slot * PB:(slot + 1) * PB] = slot % 251
    assert c.put_done(plan, wait=False) is None


def test_a_posted_put_done_is_done_before_the_next_call_answers(daemon):
    c = client(daemon)
    toks = np.arange(40, dtype=np.int32)
    stored(c, toks)
    m = c.match(toks)  # no wait between: the daemon handled the put_done first
    assert m.host_len == 10
    assert c.conn is not None and not c.conn.ledger.posted and c.conn.posted_refusals == 0
    c.release(m, wait=False)
    c.release(m, wait=False)  # twice: the second is refused (the pin is gone)
    assert c.stats()["tiers"]["host"]["pages"] == 10
    assert c.conn.posted_refusals == 1 and not c.conn.ledger.posted
    c.close()


def test_a_refused_posted_call_is_logged_and_keeps_the_connection(daemon, caplog):
    c = client(daemon)
    epoch = c.epoch
    with caplog.at_level(logging.WARNING, logger="hicache.client.connection"):
        c.release(Match(987654, [], np.zeros(0, np.int64), np.zeros(0, np.int64), 0, c.epoch), wait=False)
        assert c.match(np.arange(8, dtype=np.int32)).host_len == 0
    assert c.conn is not None and c.conn.posted_refusals == 1
    assert "refused release (sent without waiting)" in caplog.text
    assert c.connected and c.epoch == epoch and c.outages == 0
    c.close()


def test_a_hung_daemon_costs_a_posted_call_nothing_and_keeps_the_connection(daemon):
    """A waited release would miss its deadline here and drop the connection (the next
    lookups then miss while it reconnects); a posted one is only queued."""
    c = client(daemon)
    toks = np.arange(40, dtype=np.int32)
    stored(c, toks)
    m = c.match(toks)
    assert m.host_len == 10
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        c.release(m, wait=False)
        assert c.connected and c.outages == 0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    again = c.match(toks)
    assert again.host_len == 10 and c.outages == 0 and c.misses_while_away == 0
    assert c.conn is not None and c.conn.posted_refusals == 0
    c.release(again)
    c.close()


def test_unread_answers_stay_bounded(daemon):
    c = client(daemon)
    assert c.conn is not None
    for i in range(MAX_POSTED + 10):
        c.release(Match(10**6 + i, [], np.zeros(0, np.int64), np.zeros(0, np.int64), 0, c.epoch), wait=False)
    # past MAX_POSTED a `sync` went out, not waited for: its answer settles what came before it
    assert c.conn.ledger.settle is not None
    wait_until(lambda: c.poll() and c.conn.ledger.settle is None, 30, "the settling sync's answer")
    assert len(c.conn.ledger.posted) <= 10
    c.stats()
    assert not c.conn.ledger.posted and c.conn.posted_refusals == MAX_POSTED + 10
    assert c.connected and c.outages == 0
    c.close()


def test_a_noreply_request_is_answered_only_when_refused(daemon):
    s = raw(daemon.socket)
    s.sendall(pack_frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
    assert "result" in recv_frame(s)
    s.sendall(pack_frame({"id": 2, "method": "stats", "params": {}, "noreply": True})  # succeeds: no answer
              + pack_frame({"id": 3, "method": "release", "params": {"pin": 999}, "noreply": True})  # refused
              + pack_frame({"id": 4, "method": "sync", "params": {}}))
    refused = recv_frame(s)
    assert refused["id"] == 3 and refused["error"]["code"] == "NOT_FOUND"
    assert recv_frame(s) == {"id": 4, "result": True}
    s.close()


def test_wait_posted_is_one_sync_after_the_posted_calls(daemon):
    c = client(daemon)
    toks = np.arange(40, dtype=np.int32)
    stored(c, toks)
    assert c.conn is not None and len(c.conn.ledger.posted) == 1
    c.wait_posted()
    assert not c.conn.ledger.posted and c.conn.posted_refusals == 0
    c.wait_posted()  # nothing posted since
    m = c.match(toks)
    assert m.host_len == 10
    c.release(m, wait=False)
    c.close()
