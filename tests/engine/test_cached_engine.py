"""The reference engine serving through a real daemon process: KV that comes back from
host, from disk, or after a daemon restart gives the logits of recomputing it.

"From scratch" is the same model and request run by a CachedEngine without a cache.
A request served again by another engine (its own pool, its own connection) gets its
prefix from the tiers; in float32 on CPU its logits are bitwise those of the scratch
run, also when the prefix was produced inside a *shorter* request (multi-turn reuse):
the model's attention reduces over a key count set by each query's position, never by
the length of the call (see hicache/engine/attention.py).
"""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest
import torch

from hicache.client.connection import RpcConnection
from hicache.engine.attention import EngineError
from hicache.engine.cached import CachedEngine, Generation
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.daemon.serve.launcher import LocalDaemon
from tests.wait import wait_until

PAGE = 8
SMALL = dict(num_layers=2, hidden=64, head_dim=16, intermediate=128)
CONFIGS = {
    "mha": ModelConfig(**SMALL),
    "mla": ModelConfig.tiny_mla(**SMALL, kv_lora_rank=32, qk_rope_head_dim=8),
}
PROMPT_LEN = 61  # the lookup matches prompt[:-1]: 7 full pages (56 tokens), 5 tokens to compute
NEW_TOKENS = 6  # decode crosses a page boundary
CACHED = 56
DISK_FLAGS = ("--host-capacity", "8MiB", "--disk-capacity", "64MiB")
DISK_ENV = {"HICACHE_LOAD_POLICY": "wait_complete"}  # the load waits for the whole disk part


@pytest.fixture(scope="module")
def models() -> dict[str, TinyTransformer]:
    return {kind: TinyTransformer(cfg) for kind, cfg in CONFIGS.items()}



def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_engine(engines: list, model: TinyTransformer, socket: str, device_pages: int = 32) -> CachedEngine:
    e = CachedEngine.create(model, page_size=PAGE, device_pages=device_pages, socket_path=socket,
                            backoff_s=(0.01, 0.1))
    engines.append(e)
    return e


def from_scratch(model: TinyTransformer, prompt: list[int], new_tokens: int = NEW_TOKENS) -> Generation:
    e = CachedEngine.create(model, page_size=PAGE, device_pages=64, use_cache=False)
    g = e.generate(prompt, new_tokens, keep_logits=True)
    assert g is not None and g.computed_tokens == len(prompt)
    return g


def serve(engine: CachedEngine, prompt: list[int], new_tokens: int = NEW_TOKENS) -> Generation:
    g = engine.generate(prompt, new_tokens, keep_logits=True)
    assert g is not None
    return g


def assert_bitwise(g: Generation, ref: Generation) -> None:
    assert g.output_ids == ref.output_ids
    assert len(g.logits) == len(ref.logits) == len(g.output_ids)
    for step, (a, b) in enumerate(zip(g.logits, ref.logits)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"


def assert_balanced(engine: CachedEngine) -> None:
    """Every slot is back in the allocator once the cache gave back its pages."""
    engine.drain()
    assert engine.allocator.available_size() == engine.pool.num_pages * PAGE
    assert not engine.cache.refs.any()


def tiers(g: Generation) -> tuple[int, int, int, int]:
    return g.device_tokens, g.host_tokens, g.disk_tokens, g.computed_tokens


def admin(socket: str, method: str, params: dict | None = None) -> dict:
    conn = RpcConnection.connect(socket, timeout_s=10.0)
    try:
        conn.hello()
        return conn.call(method, params or {})
    finally:
        conn.close()


def wait_on_disk(socket: str, pages: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        disk = admin(socket, "stats")["tiers"]["disk"]
        if disk["pages"] >= pages and disk["queue_depth"] == 0:
            return
        time.sleep(0.02)
    raise TimeoutError(f"the disk tier did not commit {pages} pages")


# -- bitwise: the same request, its prefix from each tier ---------------------------------

@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_prefix_from_host_and_device_is_bitwise_exact(kind, models, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    model, prompt = models[kind], tokens(PROMPT_LEN, 1)
    ref = from_scratch(model, prompt)
    a = cached_engine(engines, model, d.socket)
    first = serve(a, prompt)
    assert tiers(first) == (0, 0, 0, PROMPT_LEN)
    assert_bitwise(first, ref)
    assert a.wait_backups()  # write-through: A's pages are on host now

    b = cached_engine(engines, model, d.socket)  # its own pool: nothing of this prompt on its device
    from_host = serve(b, prompt)
    assert tiers(from_host) == (0, CACHED, 0, PROMPT_LEN - CACHED)
    assert_bitwise(from_host, ref)

    from_device = serve(a, prompt)
    assert tiers(from_device) == (CACHED, 0, 0, PROMPT_LEN - CACHED)
    assert_bitwise(from_device, ref)
    for e in (a, b):
        assert_balanced(e)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_prefix_from_disk_is_bitwise_exact(kind, models, daemon_factory, engines):
    d = daemon_factory(*DISK_FLAGS, env=DISK_ENV).start()
    model, prompt = models[kind], tokens(PROMPT_LEN, 2)
    ref = from_scratch(model, prompt)
    a = cached_engine(engines, model, d.socket)
    assert_bitwise(serve(a, prompt), ref)
    assert a.wait_backups()
    wait_on_disk(d.socket, (PROMPT_LEN + NEW_TOKENS - 1) // PAGE)
    assert admin(d.socket, "flush", {"tier": "host"})["pages"] > 0  # now the disk holds the only copy

    b = cached_engine(engines, model, d.socket)
    g = serve(b, prompt)
    assert tiers(g) == (0, 0, CACHED, PROMPT_LEN - CACHED)
    assert_bitwise(g, ref)
    for e in (a, b):
        assert_balanced(e)


@pytest.mark.parametrize("kind,sig", [pytest.param("mha", signal.SIGTERM, id="mha-sigterm"),
                                      pytest.param("mla", signal.SIGTERM, id="mla-sigterm"),
                                      pytest.param("mha", signal.SIGKILL, id="mha-kill9")])
def test_engine_keeps_serving_exactly_across_a_daemon_restart(kind, sig, models, daemon_factory, engines):
    d = daemon_factory(*DISK_FLAGS, env=DISK_ENV).start()
    model, prompt = models[kind], tokens(PROMPT_LEN, 3)
    ref = from_scratch(model, prompt)
    a = cached_engine(engines, model, d.socket)
    assert_bitwise(serve(a, prompt), ref)
    assert a.wait_backups()
    wait_on_disk(d.socket, (PROMPT_LEN + NEW_TOKENS - 1) // PAGE)
    rc = d.stop(sig)
    assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    d.start()

    # The first request after the restart finds the connection stale: a miss, computed.
    other = tokens(30, 33)
    assert_bitwise(serve(a, other), from_scratch(model, other))
    # the client reconnects in the background; wait for it (adopting it here, the engine thread)
    wait_until(a.cache.client.poll, 30, "the engine's reconnect to the restarted daemon")
    # Reconnected, the engine's old device pages are forgotten; the prefix comes back from disk.
    g = serve(a, prompt)
    assert tiers(g) == (0, 0, CACHED, PROMPT_LEN - CACHED)
    assert_bitwise(g, ref)
    assert_bitwise(serve(a, prompt), ref)  # and then from its own device again
    assert_balanced(a)


# -- multi-turn reuse: the prefix computed inside a shorter request -----------------------

def two_turns(model: TinyTransformer, daemon: LocalDaemon, engines: list) -> tuple[Generation, list[int]]:
    """Turn 1 on engine A; turn 2 (turn 1 + its answer + new user tokens) on engine B."""
    a, b = cached_engine(engines, model, daemon.socket), cached_engine(engines, model, daemon.socket)
    turn1 = tokens(45, 4)
    out1 = serve(a, turn1).output_ids
    assert a.wait_backups()
    turn2 = turn1 + out1 + tokens(20, 5)
    g = serve(b, turn2)
    assert g.host_tokens == (len(turn1) + NEW_TOKENS - 1) // PAGE * PAGE  # turn 1's full pages, from host
    return g, turn2


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_prefix_from_a_shorter_request_is_equal_within_float32_rounding(kind, models, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    g, turn2 = two_turns(models[kind], d, engines)
    ref = from_scratch(models[kind], turn2)
    assert g.output_ids == ref.output_ids
    torch.testing.assert_close(torch.stack(g.logits), torch.stack(ref.logits), rtol=0, atol=1e-5)


def test_prefix_from_a_shorter_request_is_bitwise_exact(models, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    g, turn2 = two_turns(models["mha"], d, engines)
    assert_bitwise(g, from_scratch(models["mha"], turn2))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_bfloat16_within_tolerance(kind, daemon_factory, engines):
    model = TinyTransformer(dataclasses.replace(CONFIGS[kind], dtype="bfloat16"))
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    g, turn2 = two_turns(model, d, engines)
    ref = from_scratch(model, turn2, new_tokens=1)
    scale = ref.logits[0].abs().max().item()
    # bf16 keeps 8 significant bits; a prefix computed in another request moves the last ones
    torch.testing.assert_close(g.logits[0], ref.logits[0], rtol=0, atol=2 ** -6 * scale)


# -- pool pressure and ownership -----------------------------------------------------------

def test_small_pool_evicts_cached_pages_and_never_leaks(models, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    model = models["mha"]
    eng = cached_engine(engines, model, d.socket, device_pages=16)  # 128 tokens: about one conversation
    contexts = [tokens(30, 10 + c) for c in range(3)]
    for turn in range(3):
        for c in range(3):
            prompt = contexts[c] + tokens(12, 100 * turn + c)
            g = serve(eng, prompt, 4)
            ref = from_scratch(model, prompt, 4)
            assert g.output_ids == ref.output_ids
            torch.testing.assert_close(torch.stack(g.logits), torch.stack(ref.logits), rtol=0, atol=1e-5)
            contexts[c] = prompt + g.output_ids
    st = eng.stats
    assert st.failed == 0 and st.evicted_pages > 0
    assert st.host_tokens > 0  # evicted from device, back from host at the conversation's next turn
    assert st.prompt_tokens == st.computed_tokens + st.device_tokens + st.host_tokens + st.disk_tokens
    assert_balanced(eng)


def test_request_larger_than_the_pool_fails_cleanly(models, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    eng = cached_engine(engines, models["mha"], d.socket, device_pages=8)
    assert serve(eng, tokens(40, 6), 2).computed_tokens == 40
    assert eng.generate(tokens(70, 7), 2) is None  # 9 pages > 8, even with the cache emptied
    assert eng.generate(tokens(60, 8), 9) is None  # fits for prefill, runs out while decoding
    assert eng.stats.failed == 2
    assert_balanced(eng)
    assert serve(eng, tokens(40, 6), 2).device_tokens == 0  # the cache gave its pages up to make room


def test_without_a_daemon_every_request_is_computed(models, tmp_path, engines):
    model = models["mla"]
    eng = cached_engine(engines, model, str(tmp_path / "nobody.sock"))
    prompt = tokens(PROMPT_LEN, 9)
    ref = from_scratch(model, prompt)
    for _ in range(2):
        g = serve(eng, prompt)
        assert tiers(g) == (0, 0, 0, PROMPT_LEN)
        assert_bitwise(g, ref)
    assert eng.allocator.available_size() == eng.pool.num_pages * PAGE


def test_bad_requests_are_rejected(models, tmp_path, engines):
    eng = cached_engine(engines, models["mha"], str(tmp_path / "nobody.sock"))
    with pytest.raises(EngineError):
        eng.generate([1, 2, 3], 0)
    with pytest.raises(EngineError):
        eng.generate([], 3)
    with pytest.raises(EngineError):
        eng.generate([1, 2, 10_000], 3)  # outside the vocabulary
    assert eng.allocator.available_size() == eng.pool.num_pages * PAGE
    other = CachedEngine.create(models["mha"], page_size=PAGE, device_pages=8, use_cache=False)
    with pytest.raises(EngineError):
        CachedEngine(other.model, other.pool, other.allocator, eng.cache)


def test_dma_runs_serve_the_prefix_bitwise(models, daemon_factory, engines, monkeypatch):
    # Engines opt into DMA copies for page runs by environment; on CPU pools the
    # runs go as row memmoves, and the logits must not change by a bit.
    from hicache.kernels import dma

    monkeypatch.setenv("HICACHE_DMA_MIN_RUN_PAGES", "2")
    dma_pages = []
    real = dma.run_on_cpu
    monkeypatch.setattr(dma, "run_on_cpu", lambda c: dma_pages.append(int(c.height.sum())) or real(c))
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    model, prompt = models["mha"], tokens(PROMPT_LEN, 3)
    ref = from_scratch(model, prompt)
    a = cached_engine(engines, model, d.socket)
    assert_bitwise(serve(a, prompt), ref)
    assert a.wait_backups()
    b = cached_engine(engines, model, d.socket)
    assert b.cache.host.dma_min_run_pages == 2
    from_host = serve(b, prompt)
    assert tiers(from_host) == (0, CACHED, 0, PROMPT_LEN - CACHED)
    assert_bitwise(from_host, ref)
    assert sum(dma_pages) > 0  # the runs really went by DMA
    for e in (a, b):
        assert_balanced(e)


@pytest.mark.parametrize("bad", ["0", "x"])
def test_bad_dma_setting_is_refused_before_connecting(models, tmp_path, monkeypatch, bad):
    from hicache.errors import HiCacheError

    monkeypatch.setenv("HICACHE_DMA_MIN_RUN_PAGES", bad)
    with pytest.raises(HiCacheError, match="positive int|must be an integer"):
        CachedEngine.create(models["mha"], page_size=PAGE, socket_path=str(tmp_path / "none.sock"),
                            backoff_s=(0.01, 0.1))


# -- on a GPU: the whole engine path with CUDA pools (registered arena, copy kernels) ------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_cuda_engines_share_a_prefix_through_the_host_tier(kind, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    model = TinyTransformer(CONFIGS[kind], device="cuda")
    prompt = tokens(PROMPT_LEN, 1)
    ref = CachedEngine.create(model, page_size=PAGE, device_pages=64, use_cache=False).generate(
        prompt, NEW_TOKENS, keep_logits=True)
    a = CachedEngine.create(model, page_size=PAGE, device_pages=32, socket_path=d.socket, backoff_s=(0.01, 0.1))
    b = CachedEngine.create(model, page_size=PAGE, device_pages=32, socket_path=d.socket, backoff_s=(0.01, 0.1))
    engines += [a, b]
    first = serve(a, prompt)
    assert tiers(first) == (0, 0, 0, PROMPT_LEN)
    assert a.wait_backups()
    from_host = serve(b, prompt)
    assert tiers(from_host) == (0, CACHED, 0, PROMPT_LEN - CACHED)
    assert b.cache.host.backend in ("triton", "torch") and b.pool.device.type == "cuda"
    for g in (first, from_host):
        assert g.output_ids == ref.output_ids
        for x, y in zip(g.logits, ref.logits):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    for e in (a, b):
        assert_balanced(e)
