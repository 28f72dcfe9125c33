"""The hybrid reference model: restored KV + state checkpoint give exactly the recomputed outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.engine.attention import EngineError, ForwardBatch
from hicache.engine.hybrid_model import HybridConfig, HybridModel
from hicache.errors import ConfigError
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.device.state_pool import StatePool, StatePoolError

PS = 16


@pytest.fixture(scope="module")
def model():
    return HybridModel(HybridConfig())


def make_pools(model, pages=128, state_slots=16):
    pool = DevicePool(model.kv_layout(PS), num_slots=pages * PS)
    return pool, StatePool(model.state_layout(), state_slots)


def token_slots(first_page: int, n_tokens: int) -> torch.Tensor:
    return torch.arange(first_page * PS, first_page * PS + n_tokens, dtype=torch.int64)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 512, n)).to(torch.int64)


def run(model, pool, states, ids, slots, state_slot, snapshots=None, prefix=0):
    batch = ForwardBatch.build([ids[prefix:]], [slots])
    return model.forward(batch, pool, states, [state_slot], snapshots=[snapshots or {}], all_logits=True)


def test_geometry(model):
    kv, st = model.kv_layout(PS), model.state_layout()
    assert kv.num_layers == 2 and st.num_layers == 2 and st.chunk_size == 64
    c = model.config
    assert st.conv_shapes == ((c.conv_dim, c.conv_kernel - 1),)
    assert st.checkpoint_bytes == 2 * 4 * (c.conv_dim * 3 + c.lin_heads * c.lin_value_dim * c.lin_key_dim)


@pytest.mark.parametrize("cut", [64, 192, 256])
def test_restored_kv_and_state_equal_recompute_exactly(model, cut):
    pool, states = make_pools(model)
    ids = tokens(300)
    (run_slot, ckpt_slot) = states.alloc(2)
    full = run(model, pool, states, ids, token_slots(1, 300), run_slot, {cut: ckpt_slot})
    # a second request: KV of the first `cut` tokens lent (as loaded from a tier), the
    # checkpoint forked into a private slot, the rest computed
    mine = states.fork_from(ckpt_slot)
    slots = torch.cat([token_slots(1, cut), token_slots(40, 300 - cut)])
    restored = run(model, pool, states, ids, slots, mine, prefix=cut)
    assert torch.equal(restored, full[cut:])
    for buf in states.buffers:  # the final states agree too
        assert torch.equal(buf[:, mine], buf[:, run_slot])


def test_state_through_host_bytes_round_trip_is_exact(model):
    pool, states = make_pools(model)
    ids = tokens(200, seed=3)
    a, ck = states.alloc(2)
    full = run(model, pool, states, ids, token_slots(1, 200), a, {128: ck})
    blob = np.zeros(states.layout.checkpoint_bytes, dtype=np.uint8)
    states.write_to(ck, blob)
    other_states = StatePool(model.state_layout(), 4)  # another engine's pool
    (b,) = other_states.alloc(1)
    other_states.read_from(blob, b)
    restored = run(model, pool, other_states, ids, torch.cat([token_slots(1, 128), token_slots(60, 72)]), b,
                   prefix=128)
    assert torch.equal(restored, full[128:])


def test_a_checkpoint_from_another_position_does_not_reproduce(model):
    # the test above can fail: restoring the state of 128 tokens at 192 gives other logits
    pool, states = make_pools(model)
    ids = tokens(256, seed=1)
    a, at_128 = states.alloc(2)
    full = run(model, pool, states, ids, token_slots(1, 256), a, {128: at_128})
    wrong = run(model, pool, states, ids, torch.cat([token_slots(1, 192), token_slots(40, 64)]),
                states.fork_from(at_128), prefix=192)
    assert not torch.equal(wrong, full[192:])


def test_outputs_do_not_depend_on_the_batch(model):
    pool, states = make_pools(model)
    x, y = tokens(130, seed=4), tokens(70, seed=5)
    s1, s2, s3 = states.alloc(3)
    alone = run(model, pool, states, x, token_slots(1, 130), s1)
    batch = ForwardBatch.build([x, y], [token_slots(20, 130), token_slots(40, 70)])
    both = model.forward(batch, pool, states, [s2, s3], all_logits=True)
    assert torch.equal(both[:130], alone)


def test_decode_after_restore_matches_the_full_prefill(model):
    # attention is length-invariant and the recurrence runs token by token, so a decode step
    # after a restored checkpoint gives bitwise the row the whole prefill gave that token
    pool, states = make_pools(model)
    ids = tokens(140, seed=7)
    a, ck = states.alloc(2)
    full = run(model, pool, states, ids, token_slots(1, 140), a, {128: ck})
    mine = states.fork_from(ck)
    slots = torch.cat([token_slots(1, 128), token_slots(50, 12)])
    for t in range(128, 140):  # one token per step, like decode
        step = model.forward(ForwardBatch.build([ids[t:t + 1]], [slots[:t + 1]]), pool, states, [mine])
        assert torch.equal(step[0], full[t])


def test_bad_input(model):
    pool, states = make_pools(model, state_slots=2)
    ids = tokens(10)
    batch = ForwardBatch.build([ids], [token_slots(1, 10)])
    with pytest.raises(EngineError):
        model.forward(batch, pool, states, [3])
    with pytest.raises(EngineError):
        model.forward(batch, pool, states, [1], snapshots=[{11: 2}])
    with pytest.raises(EngineError):
        model.forward(batch, pool, states, [1], snapshots=[{5: 1}])
    with pytest.raises(StatePoolError):
        states.free([1])  # never allocated
    assert states.alloc(3) is None and states.available() == 2
    with pytest.raises(StatePoolError):
        states.write_to(1, np.zeros(3, dtype=np.uint8))
    with pytest.raises(ConfigError):
        HybridConfig(layer_types=("attention", "attention"))
