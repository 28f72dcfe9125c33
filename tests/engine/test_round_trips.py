"""How often a request of the reference engine waits on the daemon, against a real daemon
process: twice (match, insert) for a miss and for a prefix from host. Its other reports
(load_done, the write-through backup_done, release) are posted, and still take effect
before the engine's next call; pages it loaded twice come back through evict."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from hicache.engine.cached import CachedEngine, Generation
from hicache.engine.model import ModelConfig, TinyTransformer

PAGE = 8
PROMPT_LEN = 61  # the lookup matches prompt[:-1]: 7 full pages, 5 tokens to compute
NEW_TOKENS = 6  # prompt + 5 decoded tokens with KV: 66 tokens, 8 full pages
CACHED = 56


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(ModelConfig(num_layers=2, hidden=64, head_dim=16, intermediate=128))



def prompt_of(seed: int) -> list[int]:
    return torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(engines: list, model: TinyTransformer, socket: str) -> CachedEngine:
    e = CachedEngine.create(model, page_size=PAGE, device_pages=32, socket_path=socket, timeout_s=10.0)
    engines.append(e)
    return e


def serve_counted(e: CachedEngine, prompt: list[int]) -> tuple[Generation, Counter, Counter]:
    """Serve one request and let its backup finish; the calls it waited on and those it posted."""
    c = e.cache.client
    waited, posted = Counter(c.calls), Counter(c.posted_calls)
    g = e.generate(prompt, NEW_TOKENS, keep_logits=True)
    assert g is not None
    assert e.wait_backups()  # the backup's copy ends, and its report goes (posted)
    return g, Counter(c.calls) - waited, Counter(c.posted_calls) - posted


def assert_same(g: Generation, ref: Generation) -> None:
    assert g.output_ids == ref.output_ids
    for a, b in zip(g.logits, ref.logits):
        assert torch.equal(a, b)


def assert_balanced(e: CachedEngine) -> None:
    e.drain()
    assert e.allocator.available_size() == e.pool.num_pages * PAGE
    assert not e.cache.refs.any()


def test_a_miss_and_a_hit_from_host_each_wait_on_two_round_trips(model, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    prompt = prompt_of(1)
    ref = CachedEngine.create(model, page_size=PAGE, device_pages=32, use_cache=False).generate(
        prompt, NEW_TOKENS, keep_logits=True)
    a, b = engine(engines, model, d.socket), engine(engines, model, d.socket)

    miss, waited, posted = serve_counted(a, prompt)
    assert miss.computed_tokens == PROMPT_LEN
    assert waited == {"match": 1, "insert": 1}
    # and the engine's first measured prefill rate (fetch or recompute), posted as well
    assert posted == {"backup_done": 1, "release": 1, "report": 1}

    from_host, waited, posted = serve_counted(b, prompt)  # its own pool: the prefix comes from host
    assert (from_host.host_tokens, from_host.computed_tokens) == (CACHED, PROMPT_LEN - CACHED)
    assert_same(from_host, ref)
    assert waited == {"match": 1, "insert": 1}
    assert posted == {"load_done": 1, "release": 1}  # a stored the same 8 pages: nothing to back up

    # The posted load_done was handled before the next match: the prefix is on b's device now.
    again, waited, _ = serve_counted(b, prompt)
    assert (again.device_tokens, again.host_tokens, again.computed_tokens) == (CACHED, 0, PROMPT_LEN - CACHED)
    assert_same(again, ref)
    assert waited == {"match": 1, "insert": 1}
    for e in (a, b):
        e.cache.wait_backups()
        assert e.cache.client.conn is not None and e.cache.client.conn.posted_refusals == 0
        assert_balanced(e)


def test_pages_an_engine_loaded_twice_come_back_through_evict(model, daemon_factory, engines):
    d = daemon_factory("--host-capacity", "8MiB", "--no-disk").start()
    prompt = prompt_of(2)
    a, b = engine(engines, model, d.socket), engine(engines, model, d.socket)
    serve_counted(a, prompt)
    toks = np.asarray(prompt[:-1], dtype=np.int32)
    first, second = b.cache.lookup(toks), b.cache.lookup(toks)  # both load the host part, into their own pages
    assert first.match.host_len == second.match.host_len == CACHED // PAGE
    b.cache.finish_load(first)
    b.cache.finish_load(second)  # posted: the daemon keeps first's pages, second's are duplicates
    b.cache.release(first)
    b.cache.release(second)
    twice = second.loaded_pages
    b.cache.evict(1)  # hands the duplicates back with whatever it evicts
    assert not b.cache.cached[twice].any() and not b.cache.refs[twice].any()
    ref = CachedEngine.create(model, page_size=PAGE, device_pages=32, use_cache=False).generate(
        prompt, NEW_TOKENS, keep_logits=True)
    assert_same(b.generate(prompt, NEW_TOKENS, keep_logits=True), ref)
    assert b.cache.client.conn is not None and b.cache.client.conn.posted_refusals == 0
    assert_balanced(b)
