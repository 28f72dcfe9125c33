"""Engine: prefill over a cached prefix, decode, slot ownership, out-of-space, and
the exactness hicache relies on: a prefix whose KV bytes were copied in from
elsewhere gives bitwise the same logits as recomputing it (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from hicache.engine.attention import EngineError
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.engine.runner import Engine, Request
from hicache.errors import LayoutError
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool

PAGE = 4
CONFIGS = {"mha": ModelConfig(), "mla": ModelConfig.tiny_mla()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> TinyTransformer:
    return TinyTransformer(CONFIGS[request.param])


def make_engine(model: TinyTransformer, num_slots: int = 512, **kw: int) -> Engine:
    pool = DevicePool(model.layout(PAGE), num_slots)
    return Engine(model, pool, PagedTokenToKVPoolAllocator(num_slots, PAGE), **kw)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def copy_prefix(src: Engine, src_slots: torch.Tensor, dst: Engine, skip_pages: int = 3,
                layers: range | None = None) -> torch.Tensor:
    """Place the KV of `src_slots` into other slots of `dst`'s pool, as a load
    from the host tier would; returns the new slots (owned by the caller)."""
    dst.allocator.alloc(skip_pages * PAGE)  # so the copy lands on different slot ids
    slots = dst.allocator.alloc(src_slots.numel())
    assert slots is not None and not torch.equal(slots, src_slots)
    if layers is None:
        layers = range(src.model.config.num_layers)
    copy_layers(src, src_slots, dst, slots, layers)
    return slots


def copy_layers(src: Engine, src_slots: torch.Tensor, dst: Engine, dst_slots: torch.Tensor,
                layers: range) -> None:
    for layer in layers:
        dst.pool.k_buffers[layer][dst_slots] = src.pool.k_buffers[layer][src_slots]
        if src.pool.v_buffers:
            dst.pool.v_buffers[layer][dst_slots] = src.pool.v_buffers[layer][src_slots]


def kv_of(engine: Engine, slots: torch.Tensor) -> list[torch.Tensor]:
    return [b[slots] for b in engine.pool.k_buffers + engine.pool.v_buffers]


# -- correctness ---------------------------------------------------------------

def test_prefill_matches_dense(model: TinyTransformer) -> None:
    eng = make_engine(model)
    reqs = [Request(prompt(n, n)) for n in (29, 5, 16)]
    logits = eng.prefill(reqs)
    assert logits is not None and logits.shape == (3, 512)
    for req, row in zip(reqs, logits):
        torch.testing.assert_close(row, model.dense_logits(torch.tensor(req.token_ids))[-1], rtol=0, atol=1e-5)
        assert req.seq_len == len(req.token_ids) and req.slots.numel() == req.seq_len


@pytest.mark.parametrize("length,prefix_pages", [(37, 5), (21, 5), (22, 5), (23, 5), (8, 1), (64, 15)])
def test_loaded_prefix_gives_bitwise_equal_logits_and_kv(model: TinyTransformer, length: int,
                                                         prefix_pages: int) -> None:
    """Recompute (whole prompt in one prefill) vs load (prefix KV copied into a
    fresh pool, then prefill of the rest). Suffixes of 1-3 tokens are included:
    there BLAS would switch to other kernels and move the last bits."""
    ids = prompt(length, length)
    full = make_engine(model)
    req_full = Request(list(ids))
    logits_full = full.prefill([req_full])

    loaded = make_engine(model)
    prefix = copy_prefix(full, req_full.slots[:prefix_pages * PAGE], loaded)
    req_loaded = Request(list(ids))
    logits_loaded = loaded.prefill([req_loaded], [prefix])

    assert torch.equal(logits_full, logits_loaded)
    assert torch.equal(req_loaded.slots[:prefix.numel()], prefix)
    suffix = slice(prefix_pages * PAGE, length)
    for a, b in zip(kv_of(full, req_full.slots[suffix]), kv_of(loaded, req_loaded.slots[suffix])):
        assert torch.equal(a, b)


def test_batched_prefill_with_mixed_prefixes_is_exact_per_request(model: TinyTransformer) -> None:
    """Batching requests of different lengths and prefix lengths changes no bits."""
    ids = [prompt(n, 100 + n) for n in (33, 9, 26)]
    singles, sources = [], []
    for toks in ids:
        eng = make_engine(model)
        req = Request(list(toks))
        singles.append(eng.prefill([req])[0])
        sources.append((eng, req))

    batched = make_engine(model)
    pages = [6, 0, 3]
    prefixes = [copy_prefix(src, req.slots[:p * PAGE], batched, skip_pages=1) if p
                else torch.empty(0, dtype=torch.int64) for (src, req), p in zip(sources, pages)]
    reqs = [Request(list(t)) for t in ids]
    logits = batched.prefill(reqs, prefixes)
    for row, single in zip(logits, singles):
        assert torch.equal(row, single)


def test_decode_after_loaded_prefix_matches_recompute(model: TinyTransformer) -> None:
    ids = prompt(27, 7)
    full, loaded = make_engine(model), make_engine(model)
    req_full = Request(list(ids))
    logits_a = full.prefill([req_full])
    req_loaded = Request(list(ids))
    logits_b = loaded.prefill([req_loaded], [copy_prefix(full, req_full.slots[:24], loaded)])
    for _ in range(9):  # crosses two page boundaries
        assert torch.equal(logits_a, logits_b)
        token = int(logits_a[0].argmax())
        req_full.token_ids.append(token)
        req_loaded.token_ids.append(token)
        logits_a, logits_b = full.decode([req_full]), loaded.decode([req_loaded])
    assert torch.equal(logits_a, logits_b)
    torch.testing.assert_close(logits_a[0], model.dense_logits(torch.tensor(req_full.token_ids))[-1],
                               rtol=0, atol=1e-5)


def test_batched_decode_matches_dense(model: TinyTransformer) -> None:
    eng = make_engine(model)
    reqs = [Request(prompt(n, n)) for n in (4, 11, 17)]
    logits = eng.prefill(reqs)
    for _ in range(5):
        for req, row in zip(reqs, logits):
            req.token_ids.append(int(row.argmax()))
        logits = eng.decode(reqs)
    for req, row in zip(reqs, logits):
        torch.testing.assert_close(row, model.dense_logits(torch.tensor(req.token_ids))[-1], rtol=0, atol=1e-5)


def test_layer_hook_per_layer_load_is_exact(model: TinyTransformer) -> None:
    """The hook stands in for `load_handle.wait_layer(l)`: layer l of the prefix
    reaches the pool only inside hook(l). The pool starts as NaN, so a layer
    that read before its hook would poison the logits."""
    ids = prompt(30, 3)
    full = make_engine(model)
    req_full = Request(list(ids))
    expected = full.prefill([req_full])

    loaded = make_engine(model)
    for buf in loaded.pool.k_buffers + loaded.pool.v_buffers:
        buf.fill_(float("nan"))
    src = req_full.slots[:16]
    prefix = copy_prefix(full, src, loaded, layers=range(0))  # slots only, no bytes yet
    calls: list[int] = []

    def wait_layer(layer: int) -> None:
        calls.append(layer)
        copy_layers(full, src, loaded, prefix, range(layer, layer + 1))

    got = loaded.prefill([Request(list(ids))], [prefix], layer_hook=wait_layer)
    assert calls == list(range(model.config.num_layers))
    assert torch.equal(got, expected)


def test_generate_is_greedy_and_frees_everything(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=128)
    before = eng.allocator.available_size()
    ids = prompt(10, 1)
    out = eng.generate(ids, 6)
    assert out is not None and len(out) == 6
    seq = list(ids)
    for token in out:
        assert token == int(model.dense_logits(torch.tensor(seq))[-1].argmax())
        seq.append(token)
    assert eng.allocator.available_size() == before
    assert eng.req_to_token_pool.available_size() == 64


# -- ownership -------------------------------------------------------------------

def test_free_returns_own_slots_and_keeps_lent_and_kept_ones(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=128)
    lent = eng.allocator.alloc(2 * PAGE)
    start = eng.allocator.available_size()
    req = Request(prompt(23, 4))
    eng.prefill([req], [lent])  # 15 new tokens: 4 pages
    assert eng.allocator.available_size() == start - 4 * PAGE
    kept = req.slots[:16].clone()
    with pytest.raises(EngineError):
        eng.free(req, keep=10)  # not a page boundary
    eng.free(req, keep=16)
    assert not req.resident and req.slots.numel() == 0
    # Of the 4 new pages, the 2 under `keep` pass to the caller with the 2 lent ones.
    assert eng.allocator.available_size() == start - 2 * PAGE
    eng.allocator.free(kept)  # the caller releases what it kept and lent: no double free
    assert eng.allocator.available_size() == 128


def test_failed_forward_rolls_back(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=128)
    req = Request(prompt(12, 2))

    def broken_load(layer: int) -> None:
        if layer == 2:
            raise RuntimeError("load failed")

    with pytest.raises(RuntimeError):
        eng.prefill([req], layer_hook=broken_load)
    assert not req.resident
    assert eng.allocator.available_size() == 128 and eng.req_to_token_pool.available_size() == 64
    assert eng.prefill([req]) is not None


# -- out of space --------------------------------------------------------------

def test_prefill_out_of_slots_returns_none_and_changes_nothing(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=8 * PAGE)
    assert eng.prefill([Request(prompt(33, 0))]) is None  # 9 pages > 8
    assert eng.allocator.available_size() == 32 and eng.req_to_token_pool.available_size() == 64
    first = Request(prompt(20, 1))
    assert eng.prefill([first]) is not None  # 5 pages
    second = Request(prompt(13, 2))  # 4 pages > 3 left
    assert eng.prefill([second]) is None and not second.resident
    assert eng.allocator.available_size() == 3 * PAGE
    eng.free(first)  # the caller evicts ...
    assert eng.prefill([second]) is not None  # ... and retries


def test_decode_out_of_slots_returns_none_and_changes_nothing(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=8 * PAGE)
    a, b = Request(prompt(16, 1)), Request(prompt(16, 2))
    assert eng.prefill([a, b]) is not None  # all 8 pages
    a.token_ids.append(7)  # token 17 opens a page
    slots_before = a.slots.clone()
    assert eng.decode([a]) is None
    assert a.seq_len == 16 and torch.equal(a.slots, slots_before) and len(a.token_ids) == 17
    eng.free(b)
    assert eng.decode([a]) is not None and a.seq_len == 17


def test_out_of_rows_returns_none(model: TinyTransformer) -> None:
    eng = make_engine(model, max_requests=1)
    assert eng.prefill([Request(prompt(5, 0)), Request(prompt(5, 1))]) is None
    assert eng.allocator.available_size() == 512


def test_generate_out_of_slots_returns_none_and_frees(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=4 * PAGE)
    assert eng.generate(prompt(14, 0), 8) is None  # prompt fits, decode runs out
    assert eng.allocator.available_size() == 16 and eng.req_to_token_pool.available_size() == 64


# -- misuse -------------------------------------------------------------------------

def test_bad_prefill_input_raises_and_changes_nothing(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=64)
    pages = eng.allocator.alloc(3 * PAGE)
    avail = eng.allocator.available_size()
    ids = prompt(12, 0)
    bad = [
        ([Request(ids)], [pages[:6]]),  # not whole pages
        ([Request(ids)], [pages]),  # the whole prompt: nothing left to run
        ([Request(ids)], [pages[:8].flip(0)]),  # slots out of page order
        ([Request(ids)], [torch.arange(0, 4)]),  # the padding page
        ([Request([1, 2, 512])], None),  # token outside the vocabulary
        ([Request([])], None),
        ([Request(ids), Request(ids)], [pages[:4]]),  # one prefix for two requests
        ([], None),
    ]
    for reqs, prefix in bad:
        with pytest.raises(EngineError):
            eng.prefill(reqs, prefix)
        assert not any(r.resident for r in reqs)
    req = Request(ids)
    with pytest.raises(EngineError):
        eng.prefill([req, req])
    assert eng.allocator.available_size() == avail and eng.req_to_token_pool.available_size() == 64


def test_bad_decode_and_free_raise(model: TinyTransformer) -> None:
    eng = make_engine(model, num_slots=64)
    req = Request(prompt(6, 0))
    with pytest.raises(EngineError):
        eng.decode([req])  # not resident
    with pytest.raises(EngineError):
        eng.free(req)
    eng.prefill([req])
    with pytest.raises(EngineError):
        eng.decode([req])  # no pending token
    req.token_ids += [1, 2]
    with pytest.raises(EngineError):
        eng.decode([req])  # two pending tokens
    with pytest.raises(EngineError):
        eng.prefill([req])  # already resident
    assert req.seq_len == 6


def test_engine_rejects_a_pool_of_another_layout() -> None:
    mha, mla = TinyTransformer(CONFIGS["mha"]), TinyTransformer(CONFIGS["mla"])
    with pytest.raises(LayoutError):
        Engine(mla, DevicePool(mha.layout(PAGE), 64), PagedTokenToKVPoolAllocator(64, PAGE))
    with pytest.raises(LayoutError):
        Engine(mha, DevicePool(mha.layout(PAGE), 64), PagedTokenToKVPoolAllocator(64, 2 * PAGE))
