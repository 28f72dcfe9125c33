"""A slow or hung daemon must not stall the engine (issue 14, defect 4) nor cost it its
connection (issue 41); a dead one must not crash it.

Against a real daemon process stopped with SIGSTOP: the first call waits out its short
deadline and is a miss; every later call answers a miss at once while the connection's
liveness probe is out. A daemon that resumes within `liveness_s` answers on the same
connection (the late match's pin given back); one that stays stopped past it is taken
for dead: the connection goes and a probe reconnects in the background.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest

from hicache.client.async_client import AsyncRpcConnection
from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.deadlines import CallDeadlines
from hicache.engine.cached import CachedEngine
from hicache.engine.model import ModelConfig
from hicache.errors import ConfigError, DaemonUnavailable
from tests.daemon.test_robustness import LAYOUT
from tests.wait import wait_until

TOKENS = np.arange(32, dtype=np.int32)  # 8 pages of LAYOUT


@contextmanager
def stopped(daemon):
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


def cached_on_host(client: HiCacheClient) -> None:
    """Insert 8 pages and report their write-through backup (the host copy survives a reconnect)."""
    reply = client.insert(TOKENS, np.arange(1, 9, dtype=np.int64))
    assert reply is not None and reply.backup is not None
    assert client.backup_done(reply.backup) is not None


def host_hit(client: HiCacheClient) -> bool:
    m = client.match(TOKENS)
    client.release(m)
    return m.host_len == 8 or m.device_len == 8


def pins(daemon) -> int:
    return RpcConnection.one_call(daemon.socket, "stats", timeout_s=30)["pins"]


def test_a_stopped_daemon_costs_one_short_deadline_and_keeps_the_connection(daemon):
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket)
    try:
        assert client.connect()
        cached_on_host(client)
        assert host_hit(client)
        with stopped(daemon):
            spent = 0.0
            for _ in range(20):
                t0 = time.monotonic()
                m = client.match(TOKENS)
                spent += time.monotonic() - t0
                assert m.pin is None  # a miss answered locally
            # One match deadline (0.25 s), then nothing. Generous for a loaded 2-core machine:
            # before the breaker each lookup waited its full timeout (5 s each, ~100 s in all).
            assert spent < 2.0, spent
            assert client.late == 1 and client.misses_while_away == 20
            assert client.insert(TOKENS, np.arange(1, 9, dtype=np.int64)) is None  # a skipped store
            assert client.connected and client.outages == 0
        # resumed: the same connection answers; the late match's pin was given back
        wait_until(lambda: host_hit(client), 30, "a hit after SIGCONT")
        assert client.epoch == 1 and client.outages == 0
        assert client.conn is not None and client.conn.late_answers == 1
        wait_until(lambda: pins(daemon) == 0, 30, "the late match's pin released")
    finally:
        client.close()


def test_a_daemon_stopped_past_liveness_is_dropped_and_reconnected(daemon):
    deadlines = CallDeadlines(liveness_s=1.0)
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket, deadlines=deadlines)
    try:
        assert client.connect()
        cached_on_host(client)
        with stopped(daemon):
            assert client.match(TOKENS).pin is None  # late: a miss, the connection kept
            assert client.connected
            # no answer to the liveness probe: the connection goes at the next call after it
            wait_until(lambda: client.match(TOKENS).pin is None and client.outages == 1, 30,
                       "the connection dropped for want of a probe's answer")
            wait_until(lambda: client.reconnect_attempts > 0, 30, "a background reconnect attempt")
        wait_until(lambda: host_hit(client), 30, "a hit after SIGCONT")
        assert client.epoch == 2
    finally:
        client.close()


def test_engine_create_does_not_wait_on_a_stopped_daemon(daemon):
    """connect() lands in a stopped daemon's listen backlog: only hello's own deadline ends it."""
    with stopped(daemon):
        t0 = time.monotonic()
        engine = CachedEngine.create(ModelConfig(num_layers=1, hidden=32, head_dim=16, intermediate=64),
                                     page_size=4, device_pages=16, socket_path=daemon.socket)
        took = time.monotonic() - t0
        try:
            # connect_s (0.5 s) per step; generous for a loaded machine (it waited 10 s before)
            assert took < 5.0, took
            assert not engine.cache.client.connected
            g = engine.generate(list(range(1, 12)), 2)  # served from scratch meanwhile
            assert g is not None and g.cached_tokens == 0
        except BaseException:
            engine.close()
            raise
    try:
        wait_until(engine.cache.client.poll, 30, "the engine's reconnect after SIGCONT")
    finally:
        engine.close()


def test_the_engine_thread_runs_on_reconnect(daemon):
    """The probe reconnects on its own thread; the callbacks (EngineCache remaps the arena
    there) run on the thread that calls the client."""
    import threading

    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket, backoff_s=(0.01, 0.1))
    seen: list[tuple[int, str]] = []
    client.on_reconnect.append(lambda epoch: seen.append((epoch, threading.current_thread().name)))
    try:
        assert client.connect()
        daemon.kill9()
        assert client.match(TOKENS).pin is None
        daemon.start()
        wait_until(client.poll, 30, "a reconnect")
        me = threading.current_thread().name
        assert seen == [(1, me), (2, me)]
    finally:
        client.close()


def test_a_stale_socket_is_a_miss_and_one_clear_error(daemon):
    daemon.kill9()
    assert os.path.exists(daemon.socket)
    with pytest.raises(DaemonUnavailable, match="nothing listens"):
        RpcConnection.connect(daemon.socket)
    with pytest.raises(DaemonUnavailable, match="nothing listens"):
        asyncio.run(AsyncRpcConnection.connect(daemon.socket))
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket)
    try:
        assert not client.connect()
        assert client.match(TOKENS).pin is None
        with pytest.raises(DaemonUnavailable):
            client.stats()
    finally:
        client.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_deadlines_must_be_positive_finite_seconds(bad):
    with pytest.raises(ConfigError):
        CallDeadlines(match_s=bad)
    with pytest.raises(ValueError):
        HiCacheClient(LAYOUT, 64, model="m", socket_path="/nonexistent", timeout_s=1.0, deadlines=CallDeadlines())
