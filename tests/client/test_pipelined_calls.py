"""Pipelined calls (`RpcConnection.call_many`, `HiCacheClient.put_many`) against a real
daemon: one round trip for a batch, answers in order, a refusal only in its own place,
bad input sends nothing, and a daemon away or hung gives every put None through the
breaker, as one `put` would."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from hicache.client.client import HiCacheClient
from hicache.client.connection import MAX_PIPELINED, PIPELINE_BYTES
from hicache.errors import ClientError
from hicache.layout import KVLayout
from tests.wait import wait_until

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)
PB = LAYOUT.page_bytes


def client(d, timeout_s: float = 10.0) -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model="m", socket_path=d.socket, timeout_s=timeout_s)
    assert c.connect()
    return c


def fill(c: HiCacheClient, plan) -> None:
    """Write each reserved page's bytes (a function of its token ids' page) and finish the put."""
    assert c.arena is not None
    for slot in plan.host_pages:
        c.arena.array[slot * PB:(slot + 1) * PB] = slot % 251
    assert c.put_done(plan) == len(plan.host_pages)


def test_put_many_is_one_round_trip_with_the_plans_of_puts_in_order(daemon):
    c = client(daemon)
    stored = np.arange(100, 120, dtype=np.int32)  # 5 pages already on host
    fill(c, c.put(stored))
    fresh_a = np.arange(1000, 1012, dtype=np.int32)  # 3 new pages
    longer = np.arange(100, 128, dtype=np.int32)  # the stored 5 pages, then 2 new
    fresh_b = np.arange(2000, 2009, dtype=np.int32)  # 2 full pages, a partial one not stored
    trips, puts = c.round_trips, c.calls["put"]
    plans = c.put_many([(fresh_a, None), (stored, None), (longer, None), (fresh_b, c.page_keys(fresh_b))])
    assert c.round_trips == trips + 1 and c.calls["put"] == puts + 4
    assert all(p is not None for p in plans)
    assert [(p.present, p.put is None, len(p.host_pages)) for p in plans] == [
        (0, False, 3), (5, True, 0), (5, False, 2), (0, False, 2)]
    slots = np.concatenate([p.host_pages for p in plans])
    assert len(set(slots.tolist())) == len(slots)  # distinct reservations, as sequential puts give
    for p in plans:
        if p.put is not None:
            fill(c, p)
    for toks, n in ((fresh_a, 3), (longer, 7), (fresh_b, 2)):
        m = c.match(toks)
        assert m.host_len == n
        assert c.arena is not None
        for slot in m.host_pages:  # the bytes written into each reserved page come back
            assert (c.arena.array[slot * PB:(slot + 1) * PB] == slot % 251).all()
        c.release(m)
    trips = c.round_trips
    assert c.put_many([]) == [] and c.round_trips == trips  # nothing to ask: nothing sent
    c.close()


def test_a_refused_put_gets_none_in_its_place_and_the_others_their_plans(daemon):
    c = client(daemon)
    good = np.arange(40, dtype=np.int32)
    plans = c.put_many([(good[:8], None), (good[:4], [b"abc"]), (good, None)])  # a 3-byte key: refused
    assert plans[1] is None and c.refusals == 1
    assert plans[0] is not None and plans[0].put is not None and len(plans[0].host_pages) == 2
    assert plans[2] is not None and plans[2].put is not None and len(plans[2].host_pages) == 10
    assert c.connected and c.outages == 0
    c.close()


def test_call_many_puts_a_refusal_in_its_place_and_keeps_the_connection(daemon):
    c = client(daemon)
    assert c.conn is not None
    replies = c.conn.call_many([("stats", None), ("no_such_method", {}), ("stats", {})], 5.0)
    assert isinstance(replies[1], ClientError) and replies[1].code == "UNKNOWN_METHOD"
    assert replies[0]["tiers"]["host"]["pages"] == replies[2]["tiers"]["host"]["pages"] == 0
    assert c.conn.call_many([]) == [] and not c.conn.closed
    c.close()


def test_bad_input_raises_and_sends_nothing(daemon):
    c = client(daemon)
    toks = np.arange(16, dtype=np.int32)
    trips = c.round_trips
    with pytest.raises(ValueError, match="need 20 tokens"):
        c.put_many([(toks, None), (toks, c.page_keys(np.arange(20, dtype=np.int32)))])
    assert c.round_trips == trips and c.stats()["puts"]["puts"] == 0
    c.close()


def test_batches_past_the_window_are_answered_in_order(daemon):
    """More requests than one window holds, and frames larger than its byte bound."""
    c = client(daemon)
    many = [(np.arange(i * 8, i * 8 + 8, dtype=np.int32), None) for i in range(2 * MAX_PIPELINED + 5)]
    plans = c.put_many(many)
    assert [len(p.host_pages) for p in plans] == [2] * len(many)
    big = PIPELINE_BYTES // 4 + 64  # tokens: each frame alone fills a window
    large = [(np.arange(10**6 * (i + 1), 10**6 * (i + 1) + big, dtype=np.int32), None) for i in range(3)]
    plans = c.put_many(large)
    assert [p.present for p in plans] == [0, 0, 0] and all(len(p.host_pages) == big // 4 for p in plans)
    assert c.connected and c.refusals == 0
    c.close()


def test_a_daemon_away_gives_every_put_none_and_opens_the_breaker(daemon):
    c = client(daemon)
    daemon.stop()
    plans = c.put_many([(np.arange(8, dtype=np.int32), None), (np.arange(16, dtype=np.int32), None)])
    assert plans == [None, None] and c.outages == 1 and not c.connected
    assert c.put_many([(np.arange(8, dtype=np.int32), None)]) == [None] and c.outages == 1
    c.close()


def test_a_hung_daemon_costs_one_deadline_for_the_batch_and_gets_its_reservations_back(daemon):
    c = client(daemon, timeout_s=0.3)
    batch = [(np.arange(i * 8, i * 8 + 8, dtype=np.int32), None) for i in range(6)]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        plans = c.put_many(batch)
        waited = time.monotonic() - t0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert plans == [None] * 6 and c.late == 6
    assert waited < 6 * 0.3  # one deadline over the batch, not one per put
    # the connection stays; the late answers' reservations are given back (put_done ok=False)
    assert c.connected and c.outages == 0
    wait_until(lambda: c.poll() and c.conn is not None and not c.conn.suspect, 30, "the daemon's answers")
    assert c.stats()["puts"]["pending"] == 0
    plans = c.put_many(batch)
    assert all(p is not None and p.present == 0 for p in plans)  # nothing was kept of the late puts
    c.close()
