"""An insert the daemon answers late costs the engine neither its connection nor a page
(issue 41): its pages stay "in doubt" (never freed, never handed out) until the answer
comes, then the ones the daemon took are cached (a later lookup hits them on device) and
the rest go back to the allocator once no request holds them. A connection that dies
first leaves nothing in doubt. Real daemon processes, stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from hicache.client.deadlines import CallDeadlines
from hicache.engine.cached import CachedEngine
from hicache.engine.model import ModelConfig, TinyTransformer
from tests.wait import wait_until

PAGE = 4
POOL_PAGES = 32
TOKENS = np.arange(1, 41, dtype=np.int32)  # 10 full pages


@pytest.fixture
def engine(daemon):
    e = CachedEngine.create(TinyTransformer(ModelConfig(num_layers=1, hidden=32, head_dim=16, intermediate=64)),
                            page_size=PAGE, device_pages=POOL_PAGES, socket_path=daemon.socket,
                            deadlines=CallDeadlines(liveness_s=30.0))
    yield e
    e.close()


def free_pages(e: CachedEngine) -> int:
    return e.allocator.available_size() // PAGE


def late_store(e: CachedEngine, daemon) -> np.ndarray:
    """Look TOKENS up with the daemon running, then store its pages while it is stopped:
    the insert goes late. Returns the pages, released by their request."""
    cache = e.cache
    prefix = cache.lookup(TOKENS)
    assert prefix.num_pages == 0
    pages = cache.alloc_pages(10)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert cache.store(prefix, TOKENS, pages) is None  # a miss for now: the answer is late
        assert cache.doubt[pages].all() and cache.client.connected and cache.client.late == 1
        cache.release(prefix)
        assert free_pages(e) == POOL_PAGES - 10  # in doubt: not freed with their request
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    return pages


def test_a_late_insert_is_adopted_when_its_answer_comes(engine, daemon):
    cache = engine.cache
    pages = late_store(engine, daemon)
    wait_until(lambda: cache.client.poll() and not cache.doubt.any(), 30, "the insert's late answer")
    assert cache.cached[pages].all() and free_pages(engine) == POOL_PAGES - 10
    # the daemon tracks them as this engine's: the same connection's lookup hits them on device
    again = cache.lookup(TOKENS)
    assert np.array_equal(again.device_pages, pages)
    cache.release(again)
    assert cache.client.epoch == 1 and cache.client.outages == 0
    engine.drain()  # the daemon gives them back: nothing leaked
    assert free_pages(engine) == POOL_PAGES and not cache.cached.any()


def test_a_connection_that_dies_first_leaves_nothing_in_doubt(engine, daemon):
    cache = engine.cache
    pages = late_store(engine, daemon)
    daemon.kill9()  # the answer never comes
    assert cache.lookup(TOKENS).num_pages == 0  # the connection is gone: a miss, reconnecting
    assert not cache.client.connected
    daemon.start()
    wait_until(cache.client.poll, 30, "the reconnect")
    assert not cache.doubt.any() and not cache.cached[pages].any()
    assert free_pages(engine) == POOL_PAGES
