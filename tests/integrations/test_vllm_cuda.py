"""The vLLM connector's copy path on CUDA (`gpu` marker; skipped without CUDA; needs no
vLLM, so scripts/gpu_check.sh runs it on a bare GPU machine): vLLM-shaped per-layer
block tensors go through the registered arena and back bit for bit, by the Triton
kernel and by the torch twin; and with real streams, a save is ordered after the
step's writes, a load after the step's earlier work, and the step's stream reads a
layer only after that layer's event. The worker's use of these streams is checked on
CPU in test_vllm_streams.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.integrations.block_copy import BlockCopier
from hicache.integrations.block_streams import StreamCopies
from hicache.kernels import copy_triton
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena
from tests.wait import wait_until

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_BLOCKS = 64
LAYOUTS = {  # name -> (layout, how vLLM stores a layer's blocks)
    "token-major-bf16": (KVLayout("mha", 4, 16, "bfloat16", num_kv_heads=8, head_dim=128), "LBNHC"),
    "block-major-fp16": (KVLayout("mha", 4, 16, "float16", num_kv_heads=8, head_dim=128), "LBHNC"),
    "token-major-fp8": (KVLayout("mha", 3, 16, "float8_e4m3fn", num_kv_heads=4, head_dim=64), "LBNHC"),
    "mla-bf16": (KVLayout("mla", 3, 64, "bfloat16", kv_lora_rank=512, qk_rope_head_dim=64), "LBHNC"),
}


def vllm_caches(layout: KVLayout, order: str, seed: int, zero: bool = False) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views as vLLM 0.32 hands them to connectors, random bytes
    (made on CPU, so every run sees the same)."""
    heads, content = layout.k_heads, layout.k_dim + layout.v_dim
    phys = (NUM_BLOCKS, layout.page_size, heads, content) if order == "LBNHC" else \
        (NUM_BLOCKS, heads, layout.page_size, content)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layout.num_layers):
        raw = torch.randint(0, 256, (int(np.prod(phys)) * layout.itemsize,), dtype=torch.uint8, generator=g)
        if zero:
            raw.zero_()
        t = raw.cuda().view(getattr(torch, layout.dtype)).view(phys)
        out.append(t.permute(0, 2, 1, 3) if order == "LBNHC" else t)
    return out


def block_bytes(t: torch.Tensor, blocks) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(blocks), device=t.device)
    return t.view(torch.uint8)[ids].reshape(len(ids), -1).cpu()  # bytes: indexing of every dtype


def queue_slow_work() -> None:
    """Tens of milliseconds of matmuls on the current stream."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x / 64


@pytest.mark.parametrize("method", ["auto", "torch"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_through_the_arena_is_bit_exact(name, method):
    layout, order = LAYOUTS[name]
    rng = np.random.default_rng(0)
    blocks = rng.permutation(np.arange(1, NUM_BLOCKS))[:40]
    pages = rng.permutation(NUM_BLOCKS)[:40]
    back = rng.permutation(np.arange(1, NUM_BLOCKS))[:40]
    with HostArena.create(NUM_BLOCKS * layout.page_bytes, mlock=False) as arena:
        src = vllm_caches(layout, order, seed=1)
        saver = BlockCopier(src, NUM_BLOCKS, layout, arena, method=method)
        if method == "auto":
            assert saver.method == ("triton" if copy_triton.triton_usable(torch.device("cuda")) else "torch")
        assert arena.cuda_registered
        saver.save(blocks, pages)
        torch.cuda.synchronize()
        host = saver.host[torch.as_tensor(pages)]  # [page, layer, bytes]
        for layer, t in enumerate(src):
            assert torch.equal(host[:, layer], block_bytes(t, blocks)), layer
        dst = vllm_caches(layout, order, seed=2, zero=True)
        loader = BlockCopier(dst, NUM_BLOCKS, layout, arena, method=method)
        for layer in range(layout.num_layers):
            loader.load_layer(layer, back, pages)
        torch.cuda.synchronize()
        others = sorted(set(range(NUM_BLOCKS)) - set(back.tolist()))
        for s, d in zip(src, dst):
            assert torch.equal(block_bytes(d, back), block_bytes(s, blocks))
            assert not block_bytes(d, others).any()


def test_streams_order_saves_after_the_step_and_layers_before_their_use():
    layout, order = LAYOUTS["token-major-bf16"]
    blocks, pages = list(range(1, 33)), list(range(32))
    with HostArena.create(NUM_BLOCKS * layout.page_bytes, mlock=False) as arena:
        caches = vllm_caches(layout, order, seed=3)
        copier = BlockCopier(caches, NUM_BLOCKS, layout, arena)
        streams = StreamCopies(copier)
        done: list[float] = []
        # The step's last work writes the blocks; the save is queued at once, host never waits.
        queue_slow_work()
        for layer, t in enumerate(caches):
            t[1:33] = float(layer + 1)
        streams.save([lambda: copier.save(blocks, pages)], [], lambda secs, errors: done.append(errors))
        wait_until(lambda: streams.poll() or done, 30, "the save to complete")
        assert done == [[None]]
        host = copier.host[torch.as_tensor(pages)].view(torch.bfloat16)
        for layer in range(layout.num_layers):
            assert (host[:, layer] == float(layer + 1)).all(), layer  # the step's writes, not older bytes

        # A load into other blocks, queued behind the step's work; the step reads each
        # layer right after waiting on that layer's event.
        dst = list(range(33, 64))
        dst_pages = pages[: len(dst)]
        loaded: list[float] = []
        queue_slow_work()
        for t in caches:
            t[33:64] = -1.0  # the blocks' previous owner, still writing
        events, error = streams.load([(dst, dst_pages)] * layout.num_layers, lambda secs, err: loaded.append(secs))
        assert error is None and len(events) == layout.num_layers
        seen = []
        for layer in range(layout.num_layers):
            streams.wait_layer(events[layer])
            seen.append(caches[layer][33:64].clone())
        torch.cuda.current_stream().synchronize()
        for layer, got in enumerate(seen):
            assert (got == float(layer + 1)).all(), layer
        wait_until(lambda: streams.poll() or loaded, 30, "the load to be reported")
        assert loaded[0] > 0 and not streams.busy
