"""An unreachable daemon never costs the engine a request that fits its pool (issue 25).

The scene of the issue, against real daemon processes: a 96-page pool holds 84 cached
pages of three earlier prompts and 12 free ones; the daemon is stopped (SIGSTOP) or
restarted; a prompt of 203 tokens (52 pages with its answer) arrives. The daemon cannot
give cached pages back, so the engine takes them back itself (they are only a cache):
the prompt is computed and its logits are bitwise those of recomputing it. After the
daemon answers again, the engine is a new registration: the daemon tracks none of the
pages the engine reused (no device hit on them), and the old prompts come back from
the host or disk tier, still bitwise exact. A copy into or out of the daemon's host
pages ends before the connection that planned it closes.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from hicache.client.connection import RpcConnection
from hicache.client.deadlines import CallDeadlines
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.engine.cached import CachedEngine, Generation
from hicache.engine.model import ModelConfig, TinyTransformer
from tests.wait import wait_until

PAGE = 4
POOL_PAGES = 96
NEW_TOKENS = 4
OLD_LEN = 110  # with its answer 113 tokens: 28 full pages cached per prompt, 84 for three
NEW_LEN = 203  # 206 tokens with its answer: 52 pages, more than the 12 left free
OLD_CACHED = (OLD_LEN - 1) // PAGE * PAGE  # the lookup matches prompt[:-1]: 27 pages
CONFIG = ModelConfig(num_layers=2, hidden=64, head_dim=16, intermediate=128)
DISK_FLAGS = ("--host-capacity", "8MiB", "--disk-capacity", "64MiB")
DISK_ENV = {"HICACHE_LOAD_POLICY": "wait_complete"}  # the load waits for the whole disk part


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG)



def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_pool_engine(engines: list, model: TinyTransformer, socket: str) -> tuple[CachedEngine, list[list[int]]]:
    """An engine whose pool holds 84 cached pages of three served prompts, 12 free."""
    e = CachedEngine.create(model, page_size=PAGE, device_pages=POOL_PAGES, socket_path=socket,
                            backoff_s=(0.01, 0.1))
    engines.append(e)
    olds = [tokens(OLD_LEN, seed) for seed in range(3)]
    for p in olds:
        assert_exact(serve(e, p), model, p)
    assert int(e.cache.cached.sum()) == 84 and free_pages(e) == 12
    return e, olds


def serve(engine: CachedEngine, prompt: list[int]) -> Generation:
    g = engine.generate(prompt, NEW_TOKENS, keep_logits=True)
    assert g is not None, "the request was refused"
    return g


def assert_exact(g: Generation, model: TinyTransformer, prompt: list[int]) -> None:
    scratch = CachedEngine.create(model, page_size=PAGE, device_pages=POOL_PAGES, use_cache=False)
    ref = scratch.generate(prompt, NEW_TOKENS, keep_logits=True)
    assert ref is not None and g.output_ids == ref.output_ids
    for step, (a, b) in enumerate(zip(g.logits, ref.logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"


def free_pages(engine: CachedEngine) -> int:
    return engine.allocator.available_size() // PAGE


def assert_balanced(engine: CachedEngine) -> None:
    engine.drain()
    assert free_pages(engine) == POOL_PAGES
    assert not engine.cache.refs.any()


def page_bytes(engine: CachedEngine, pages: np.ndarray) -> torch.Tensor:
    """Every byte of these device pages' KV, all layers."""
    slots = (torch.from_numpy(np.asarray(pages, dtype=np.int64))[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    pool = engine.pool
    return torch.cat([torch.cat([pool.get_key_buffer(layer)[slots].flatten(),
                                 pool.get_value_buffer(layer)[slots].flatten()])
                      for layer in range(pool.layout.num_layers)]).clone()


@contextmanager
def stopped(daemon: LocalDaemon) -> Iterator[None]:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


def daemon_engines(socket: str) -> dict[int, int]:
    """engine id -> the device pages the daemon records for it."""
    conn = RpcConnection.connect(socket, timeout_s=10.0)
    try:
        conn.hello()
        return {r["engine"]: r["resident_pages"] for r in conn.call("stats", {})["engines"]}
    finally:
        conn.close()


def wait_daemon_tracks_only(engine: CachedEngine, socket: str) -> None:
    """The daemon dropped the old registration: it records for the engine exactly the
    pages the engine holds as cached."""
    client = engine.cache.client
    wait_until(client.poll, 30, "the engine's reconnect")
    wait_until(lambda: daemon_engines(socket) == {client.engine_id: int(engine.cache.cached.sum())}, 30,
               "the daemon tracking only the engine's new registration")


def wait_on_disk(socket: str, pages: int) -> None:
    def committed() -> bool:
        conn = RpcConnection.connect(socket, timeout_s=10.0)
        try:
            conn.hello()
            disk = conn.call("stats", {})["tiers"]["disk"]
        finally:
            conn.close()
        return disk["pages"] >= pages and disk["queue_depth"] == 0
    wait_until(committed, 30, f"{pages} pages committed to disk")


@pytest.mark.parametrize("settled", [True, False], ids=["backups-reported", "backups-in-flight"])
def test_a_full_pool_serves_a_prompt_that_fits_while_the_daemon_is_stopped(settled, model, daemon_factory,
                                                                           engines):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    e, olds = full_pool_engine(engines, model, d.socket)
    if settled:
        assert e.wait_backups()  # else the last prompt's backup is reported to the stopped daemon
    new = tokens(NEW_LEN, 99)
    with stopped(d):
        g = serve(e, new)
        assert g.computed_tokens == NEW_LEN
        assert_exact(g, model, new)
        assert not e.cache.client.connected and e.stats.failed == 0
        assert not e.cache.cached.any() and not e.cache.backups
        assert_exact(serve(e, olds[0]), model, olds[0])  # a miss while away, computed
    # resumed: a new registration that the daemon tracks no reused page for
    wait_daemon_tracks_only(e, d.socket)
    g = serve(e, olds[0])
    assert (g.device_tokens, g.host_tokens) == (0, OLD_CACHED)  # from host, into fresh pages
    assert_exact(g, model, olds[0])
    assert_exact(serve(e, new), model, new)  # its store was skipped while away: computed
    g = serve(e, new)
    assert g.device_tokens == NEW_LEN - 1 - (NEW_LEN - 1) % PAGE  # the new registration's own pages
    assert_exact(g, model, new)
    assert_balanced(e)


def test_a_full_pool_serves_a_prompt_that_fits_across_a_daemon_restart(model, daemon_factory, engines):
    d = daemon_factory(*DISK_FLAGS, env=DISK_ENV).start()
    e, olds = full_pool_engine(engines, model, d.socket)
    assert e.wait_backups()
    wait_on_disk(d.socket, 84)
    d.stop(signal.SIGKILL)
    d.start()
    new = tokens(NEW_LEN, 98)
    g = serve(e, new)  # the first call finds the old connection dead
    assert g.computed_tokens == NEW_LEN and e.stats.failed == 0
    assert_exact(g, model, new)
    wait_daemon_tracks_only(e, d.socket)
    for p in olds:
        g = serve(e, p)
        assert (g.device_tokens, g.disk_tokens) == (0, OLD_CACHED)  # no page of the old residency
        assert_exact(g, model, p)
    assert_balanced(e)


def test_pages_a_running_request_holds_stay_until_its_release(model, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    e, olds = full_pool_engine(engines, model, d.socket)
    assert e.wait_backups()
    held = e.cache.lookup(np.asarray(olds[0][:-1], dtype=np.int32))  # a request still running
    assert held.match.device_len == OLD_CACHED // PAGE
    kv_before = page_bytes(e, held.device_pages)
    new = tokens(NEW_LEN, 97)
    with stopped(d):
        assert_exact(serve(e, new), model, new)  # 12 free + the 57 idle cached pages
        assert torch.equal(page_bytes(e, held.device_pages), kv_before)  # never handed out
        assert free_pages(e) == POOL_PAGES - len(held.device_pages)
        e.cache.release(held)
        assert free_pages(e) == POOL_PAGES
    wait_daemon_tracks_only(e, d.socket)
    g = serve(e, olds[0])
    assert (g.device_tokens, g.host_tokens) == (0, OLD_CACHED)
    assert_exact(g, model, olds[0])
    assert_balanced(e)


def test_a_copy_in_flight_ends_before_a_dead_daemons_connection_closes(model, daemon_factory, engines):
    """Once the daemon sees the connection close it unpins the match's host pages (another
    engine's backup may then write them), so the load reading them must be over first."""
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    a, olds = full_pool_engine(engines, model, d.socket)
    assert a.wait_backups()
    b = CachedEngine.create(model, page_size=PAGE, device_pages=POOL_PAGES, socket_path=d.socket,
                            backoff_s=(0.01, 0.1), deadlines=CallDeadlines(liveness_s=1.0))
    engines.append(b)
    gate = threading.Event()
    b.cache.executor.on_layer_done = lambda layer: gate.wait(30)  # the load stays in flight
    prefix = b.cache.lookup(np.asarray(olds[0][:-1], dtype=np.int32))
    assert prefix.load is not None and not prefix.load.done()
    client = b.cache.client
    at_close: list[tuple[bool, bool]] = []
    client.on_disconnect.insert(0, gate.set)  # the copy may go on only once the breaker opens
    client.on_disconnect.append(lambda: at_close.append((prefix.load.done(), client.conn.sock.fileno() == -1)))
    with stopped(d):
        assert client.match(np.asarray(olds[1], dtype=np.int32)).pin is None  # late: a miss, the connection stays
        assert at_close == [] and client.connected
        # no answer to the liveness probe: the next call after liveness_s ends the connection
        wait_until(lambda: client.match(np.asarray(olds[1], dtype=np.int32)).pin is None and not client.connected,
                   30, "the connection ended for want of a probe's answer")
        assert at_close == [(True, False)]  # the copy was over while the connection still lived
        b.cache.finish_load(prefix)
        assert not b.cache.cached[prefix.loaded_pages].any()  # the copies stay the request's own
        b.cache.release(prefix)
    assert_balanced(b)
