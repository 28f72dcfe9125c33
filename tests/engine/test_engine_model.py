"""TinyTransformer: config, weights, layout, and the paged forward against the dense reference."""

from __future__ import annotations

import pytest
import torch

from hicache.engine.attention import EngineError, ForwardBatch, rowdot
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.errors import ConfigError, LayoutError
from hicache.tiers.device.pool import DevicePool

CONFIGS = {"mha": ModelConfig(), "mla": ModelConfig.tiny_mla()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> TinyTransformer:
    return TinyTransformer(CONFIGS[request.param])


def _tokens(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# -- config, weights, layout ----------------------------------------------

@pytest.mark.parametrize("bad", [
    dict(attention="gqa"),
    dict(num_heads=6, num_kv_heads=4),
    dict(head_dim=31),
    dict(hidden=0),
    dict(dtype="int8"),
    dict(kv_lora_rank=16),  # MLA fields on an MHA model
    dict(attention="mla", num_kv_heads=1),  # MLA without kv_lora_rank
    dict(attention="mla", num_kv_heads=2, kv_lora_rank=64, qk_rope_head_dim=16),
    dict(attention="mla", num_kv_heads=1, kv_lora_rank=64, qk_rope_head_dim=15),
])
def test_bad_config_is_rejected(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ModelConfig(**bad)


def test_weights_are_deterministic_per_seed() -> None:
    a, b = TinyTransformer(ModelConfig(seed=7)), TinyTransformer(ModelConfig(seed=7))
    c = TinyTransformer(ModelConfig(seed=8))
    ids = _tokens(9, 0)
    assert torch.equal(a.dense_logits(ids), b.dense_logits(ids))
    assert not torch.equal(a.dense_logits(ids), c.dense_logits(ids))


def test_layout_matches_what_the_model_writes(model: TinyTransformer) -> None:
    c = model.config
    layout = model.layout(4)
    pool = DevicePool(layout, 64)
    if c.is_mla:
        assert (layout.kind, layout.kv_lora_rank, layout.qk_rope_head_dim) == ("mla", 64, 16)
        assert pool.k_buffers[0].shape[1:] == (1, c.kv_lora_rank + c.qk_rope_head_dim) and pool.v_buffers == []
    else:
        assert (layout.kind, layout.num_kv_heads, layout.head_dim, layout.v_head_dim) == ("mha", 2, 32, 32)
    slots = torch.arange(4, 12)
    model.forward(ForwardBatch.build([_tokens(8, 1)], [slots]), pool)
    for layer in range(c.num_layers):
        for buf in [pool.k_buffers[layer]] + pool.v_buffers[layer:layer + 1]:
            assert buf[slots].abs().sum(-1).min() > 0  # every written row is data
            assert not buf[:4].any() and not buf[12:].any()  # nothing else was touched
    assert layout.bytes_per_token == sum(
        b[0].numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)


def test_forward_rejects_a_foreign_pool(model: TinyTransformer) -> None:
    other = CONFIGS["mla" if not model.config.is_mla else "mha"]
    pool = DevicePool(TinyTransformer(other).layout(4), 64)
    with pytest.raises(LayoutError):
        model.forward(ForwardBatch.build([_tokens(3, 0)], [torch.arange(4, 7)]), pool)


# -- rowdot -----------------------------------------------------------------

@pytest.mark.parametrize("k,n", [(128, 384), (32, 7), (96, 33)])
def test_rowdot_rows_do_not_depend_on_the_batch(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(70, k, generator=gen), torch.randn(n, k, generator=gen)
    full = rowdot(a, b)
    torch.testing.assert_close(full, a @ b.T, rtol=1e-5, atol=1e-4)
    for start, m in [(0, 1), (5, 1), (3, 2), (10, 3), (17, 16), (1, 69)]:
        assert torch.equal(rowdot(a[start:start + m], b), full[start:start + m])


def test_rowdot_chunking_does_not_change_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache.engine.attention as attention
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 50, 64, generator=gen), torch.randn(2, 40, 64, generator=gen)
    whole = rowdot(a, b)
    monkeypatch.setattr(attention, "MAX_PRODUCT_ELEMS", 2 * 40 * 64 * 3)  # 3 rows per chunk
    assert torch.equal(attention.rowdot(a, b), whole)


# -- paged forward vs dense -----------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_forward_matches_dense_at_every_position(model: TinyTransformer, page_size: int) -> None:
    pool = DevicePool(model.layout(page_size), 256)
    seqs = [_tokens(n, seed) for seed, n in enumerate([23, 1, 40])]
    # Scattered, non-contiguous slots: the forward must follow the slot lists.
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(0)) + page_size
    slot_lists, off = [], 0
    for s in seqs:
        slot_lists.append(perm[off:off + s.numel()])
        off += s.numel()
    logits = model.forward(ForwardBatch.build(seqs, slot_lists), pool, all_logits=True)
    dense = torch.cat([model.dense_logits(s) for s in seqs])
    torch.testing.assert_close(logits, dense, rtol=0, atol=1e-5)
    last = model.forward(ForwardBatch.build(seqs, slot_lists), pool)
    assert torch.equal(last, logits[torch.tensor([22, 23, 63])])


def test_extend_over_a_prefix_in_the_pool_matches_dense(model: TinyTransformer) -> None:
    pool = DevicePool(model.layout(4), 128)
    ids = _tokens(30, 5)
    slots = torch.arange(4, 34)
    model.forward(ForwardBatch.build([ids[:12]], [slots[:12]]), pool)
    logits = model.forward(ForwardBatch.build([ids[12:]], [slots]), pool, all_logits=True)
    torch.testing.assert_close(logits, model.dense_logits(ids)[12:], rtol=0, atol=1e-5)


def test_layer_hook_runs_once_per_layer_between_write_and_read(model: TinyTransformer) -> None:
    pool = DevicePool(model.layout(4), 64)
    slots = torch.arange(4, 14)
    calls: list[int] = []

    def hook(layer: int) -> None:
        # This layer's KV is written already, the next layer's not yet.
        assert pool.k_buffers[layer][slots].any()
        if layer + 1 < model.config.num_layers:
            assert not pool.k_buffers[layer + 1][slots].any()
        calls.append(layer)

    model.forward(ForwardBatch.build([_tokens(10, 2)], [slots]), pool, layer_hook=hook)
    assert calls == list(range(model.config.num_layers))


def test_forward_batch_rejects_malformed_input() -> None:
    with pytest.raises(EngineError):
        ForwardBatch.build([], [])
    with pytest.raises(EngineError):
        ForwardBatch.build([torch.arange(5)], [torch.arange(4)])  # more new tokens than slots
    with pytest.raises(EngineError):
        ForwardBatch.build([torch.arange(0)], [torch.arange(4)])  # nothing to run
    with pytest.raises(EngineError):
        ForwardBatch.build([torch.arange(2)], [torch.arange(4), torch.arange(4)])


def test_positions_beyond_max_positions_are_rejected() -> None:
    model = TinyTransformer(ModelConfig(max_positions=16))
    pool = DevicePool(model.layout(4), 64)
    with pytest.raises(EngineError):
        model.forward(ForwardBatch.build([_tokens(2, 0)], [torch.arange(4, 21)]), pool)
