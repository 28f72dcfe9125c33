"""Length invariance of the paged forward, float32 on CPU, bitwise.

A token's KV and logits must not depend on how long the call that computed
them was: a prefix computed inside a short prompt, by an earlier turn, or one
decode step at a time must carry the bits a single long prefill gives it. That
is what lets hicache hand a multi-turn prefix from another request to a new one
(the bitwise end-to-end check is in test_cached_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from hicache.engine.attention import ATTN_BLOCK, EngineError, ForwardBatch, attention_width, causal_attend
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.tiers.device.pool import DevicePool

SMALL = dict(num_layers=2, hidden=64, head_dim=16, intermediate=128)
CONFIGS = {
    "mha": ModelConfig(**SMALL),
    "mla": ModelConfig.tiny_mla(**SMALL, kv_lora_rank=32, qk_rope_head_dim=8),
}
PAGE = 4
LONGEST = 289
# Around and across the block boundaries: inside the first block, on it, just past it, several blocks.
LENGTHS = (16, 40, 64, 65, 200, LONGEST)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> TinyTransformer:
    return TinyTransformer(CONFIGS[request.param])


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (LONGEST,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def scratch(model: TinyTransformer, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All logits and every layer's KV of one prefill of the longest prompt."""
    pool, slots = new_pool(model), slot_list(LONGEST)
    logits = model.forward(ForwardBatch.build([ids], [slots]), pool, all_logits=True)
    return logits, kv_of(pool, slots)


def new_pool(model: TinyTransformer) -> DevicePool:
    return DevicePool(model.layout(PAGE), 768)


def slot_list(n: int, seed: int = 0) -> torch.Tensor:
    """`n` slots scattered over the pool (page 0 is padding): the forward must follow the list."""
    perm = torch.randperm(2 * LONGEST, generator=torch.Generator().manual_seed(seed))
    return perm[:n] + PAGE


def kv_of(pool: DevicePool, slots: torch.Tensor) -> list[torch.Tensor]:
    """K (MLA: latent) and, for MHA, V of `slots`, per layer, in token order."""
    return [buf[slots].clone() for buf in pool.k_buffers + pool.v_buffers]


def assert_kv_equal(got: list[torch.Tensor], want: list[torch.Tensor], n: int) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a[:n], b[:n]), f"buffer {i}: max diff {(a[:n] - b[:n]).abs().max().item()}"


# -- the attention kernel itself ------------------------------------------------------------

def test_width_depends_on_the_position_block_only() -> None:
    assert [attention_width(p) for p in (0, 1, ATTN_BLOCK - 1)] == [ATTN_BLOCK] * 3
    assert attention_width(ATTN_BLOCK) == attention_width(2 * ATTN_BLOCK - 1) == 2 * ATTN_BLOCK
    assert attention_width(5 * ATTN_BLOCK + 3) == 6 * ATTN_BLOCK


@pytest.mark.parametrize("length", [1, 7, 64, 65, 130])
def test_each_query_row_is_its_own_one_query_call(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(length, 4, d, generator=gen) for d in (16, 16, 8))
    full = causal_attend(q, k, v, 0.25)
    for p in sorted({0, length // 2, length - 1, min(length - 1, ATTN_BLOCK - 1), min(length - 1, ATTN_BLOCK)}):
        # The query at p alone, over only the keys it sees (a decode step), and as the tail of a call.
        alone = causal_attend(q[p:p + 1], k[:p + 1], v[:p + 1], 0.25)
        assert torch.equal(alone[0], full[p]), f"position {p}"
        tail = causal_attend(q[p:], k, v, 0.25)
        assert torch.equal(tail, full[p:])


def test_causal_attend_matches_textbook_attention() -> None:
    gen = torch.Generator().manual_seed(5)
    n, heads = 150, 3
    q, k, v = (torch.randn(n, heads, d, generator=gen, dtype=torch.float64) for d in (16, 16, 8))
    scores = torch.einsum("thd,shd->hts", q, k) * 0.25
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    want = torch.einsum("hts,she->the", torch.softmax(scores.masked_fill(future, float("-inf")), -1), v)
    got = causal_attend(q.float(), k.float(), v.float(), 0.25)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_causal_attend_rejects_mismatched_shapes() -> None:
    q, k = torch.zeros(5, 2, 8), torch.zeros(4, 2, 8)
    with pytest.raises(EngineError):
        causal_attend(q, k, k, 1.0)  # more queries than keys
    with pytest.raises(EngineError):
        causal_attend(q[:2], k, k[:3], 1.0)  # keys and values of different lengths


# -- the model: a prefix's bits do not depend on the call that computed it -------------------

def test_prefix_kv_and_logits_do_not_depend_on_the_prompt_length(model, ids, scratch) -> None:
    want_logits, want_kv = scratch
    for n in LENGTHS[:-1]:
        pool, slots = new_pool(model), slot_list(n, seed=n)
        logits = model.forward(ForwardBatch.build([ids[:n]], [slots]), pool, all_logits=True)
        assert_kv_equal(kv_of(pool, slots), want_kv, n)
        assert torch.equal(logits, want_logits[:n]), f"prompt of {n} tokens"


def test_turns_extending_a_shorter_requests_prefix_equal_one_prefill(model, ids, scratch) -> None:
    """Multi-turn reuse: each turn computes only its new tokens over the KV earlier turns left."""
    want_logits, want_kv = scratch
    pool, slots = new_pool(model), slot_list(LONGEST, seed=1)
    done = 0
    for n in LENGTHS:
        logits = model.forward(ForwardBatch.build([ids[done:n]], [slots[:n]]), pool, all_logits=True)
        assert torch.equal(logits, want_logits[done:n]), f"turn {done}..{n}"
        done = n
    assert_kv_equal(kv_of(pool, slots), want_kv, LONGEST)


def test_decode_steps_equal_prefill_at_the_same_positions(model, ids, scratch) -> None:
    """Prefill, decode across a block boundary, extend to just short of the next one, decode across it."""
    want_logits, want_kv = scratch
    b = ATTN_BLOCK
    stop = 2 * b + 2
    pool, slots = new_pool(model), slot_list(stop, seed=2)
    decoded = [*range(b - 2, b + 2), *range(2 * b - 1, stop)]
    done = 0
    for p in decoded:
        if p > done:  # a prefill / extend up to p
            out = model.forward(ForwardBatch.build([ids[done:p]], [slots[:p]]), pool)
            assert torch.equal(out[0], want_logits[p - 1]), f"prefill ending at position {p - 1}"
        step = model.forward(ForwardBatch.build([ids[p:p + 1]], [slots[:p + 1]]), pool)
        assert torch.equal(step[0], want_logits[p]), f"decode at position {p}"
        done = p + 1
    assert_kv_equal(kv_of(pool, slots), want_kv, stop)


def test_a_request_is_the_same_alone_and_batched_with_others(model, ids, scratch) -> None:
    """Mixed batch: a prefill, an extend over a cached prefix and a decode, all of different lengths."""
    want_logits, _ = scratch
    pool = new_pool(model)
    perm = torch.randperm(pool.num_pages * PAGE, generator=torch.Generator().manual_seed(3)) + PAGE
    a, b, c = perm[:70], perm[70:70 + 200], perm[270:270 + 131]
    model.forward(ForwardBatch.build([ids[:150]], [b[:150]]), pool)  # b's cached prefix
    model.forward(ForwardBatch.build([ids[:130]], [c[:130]]), pool)  # c's cached prefix
    logits = model.forward(ForwardBatch.build([ids[:70], ids[150:200], ids[130:131]], [a, b, c]), pool,
                           all_logits=True)
    assert torch.equal(logits[:70], want_logits[:70])
    assert torch.equal(logits[70:120], want_logits[150:200])
    assert torch.equal(logits[120], want_logits[130])
