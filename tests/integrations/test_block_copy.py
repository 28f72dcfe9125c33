"""BlockCopier's copy methods on the layouts backends hand out: vLLM's CPU view
[B, H, N, 2*D] (block dim 0), the CUDA flash-attention shape [2, B, N, H, D]
(block dim 1, K and V apart) and vLLM 0.32's CUDA default (a block stored
token-major, seen as [B, H, N, 2*D]), fp32 and bf16, blocks and pages in no
order. The native and triton paths copy by raw address: guard bytes around
every KV tensor must come through untouched, and bad input must copy nothing.
The triton path runs in Triton's interpreter, in a child process (the
interpreter is chosen before the first kernel is built)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.errors import LayoutError
from hicache.integrations.block_copy import BlockCopier, BlockRuns
from hicache.kernels import triton_env
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena

NUM_BLOCKS = 13
LAYERS, HEADS, BLOCK, HEAD = 3, 2, 16, 32
GUARD = 4096  # bytes before and after each layer's tensor in its buffer


def _shape(kind: str) -> tuple[int, ...]:
    return {"cpu": (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),  # vLLM CPU: per block and head, K then V
            "cuda": (2, NUM_BLOCKS, BLOCK, HEADS, HEAD),  # flash-attention: K of every block, then V
            "heads-outer": (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
            "token-major": (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)}[kind]


def make_caches(kind: str, dtype: torch.dtype, seed: int,
                zero: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer KV tensors (random bytes, NaNs included, or zeros), each a view into the
    middle of a guarded buffer: (tensors, buffers)."""
    g = torch.Generator().manual_seed(seed)
    shape = _shape(kind)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    caches, bufs = [], []
    for _ in range(LAYERS):
        buf = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, generator=g)
        if zero:
            buf[GUARD:GUARD + nbytes] = 0
        t = buf[GUARD:GUARD + nbytes].view(dtype)
        if kind == "heads-outer":  # a backend whose physical order puts heads first, seen as [B, H, N, C]
            t = t.view(HEADS, NUM_BLOCKS, BLOCK, 2 * HEAD).permute(1, 0, 2, 3)
        elif kind == "token-major":  # vLLM's CUDA default (LBNHC): [B, N, H, C] in memory, seen as [B, H, N, C]
            t = t.view(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3)
        else:
            t = t.view(shape)
        caches.append(t)
        bufs.append(buf)
    return caches, bufs


def layout_for(dtype: torch.dtype) -> KVLayout:
    return KVLayout("mha", LAYERS, BLOCK, str(dtype).removeprefix("torch."), num_kv_heads=HEADS, head_dim=HEAD)


def block_bytes(t: torch.Tensor, kind: str, blocks: list[int]) -> torch.Tensor:
    v = t.movedim(1, 0) if kind == "cuda" else t
    return v[blocks].reshape(len(blocks), -1).contiguous().view(torch.uint8)


def guards(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([b[:GUARD], b[-GUARD:]]).clone() for b in bufs]


@pytest.mark.parametrize("method", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["cpu", "cuda", "heads-outer"])
def test_save_then_per_layer_load_is_byte_exact(kind, dtype, method):
    layout = layout_for(dtype)
    saved, loaded, pages = [9, 2, 11, 4, 0], [1, 12, 5, 7, 3], [6, 0, 14, 3, 9]
    with HostArena.create(16 * layout.page_bytes, mlock=False) as arena:
        src, src_bufs = make_caches(kind, dtype, seed=1)
        before = [b.clone() for b in src_bufs]
        saver = BlockCopier(src, NUM_BLOCKS, layout, arena, method=method)
        assert saver.method == method
        saver.save(saved, pages)
        assert all(torch.equal(a, b) for a, b in zip(src_bufs, before))  # a save only reads the KV
        page_view = saver.host[torch.tensor(pages)]  # [n, layer, bytes]
        for layer, t in enumerate(src):  # the page keeps each block's bytes in logical order
            assert torch.equal(page_view[:, layer], block_bytes(t, kind, saved))

        dst, dst_bufs = make_caches(kind, dtype, seed=2, zero=True)
        outside = guards(dst_bufs)
        loader = BlockCopier(dst, NUM_BLOCKS, layout, arena, method=method)
        for layer in range(LAYERS):
            loader.load_layer(layer, loaded, pages)
            for later in range(layer + 1, LAYERS):  # one layer at a time
                assert not dst[later].view(torch.uint8).any()
        others = [b for b in range(NUM_BLOCKS) if b not in loaded]
        for s, d in zip(src, dst):
            assert torch.equal(block_bytes(d, kind, loaded), block_bytes(s, kind, saved))
            assert not block_bytes(d, kind, others).any()
        assert all(torch.equal(a, b) for a, b in zip(guards(dst_bufs), outside))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["cpu", "cuda", "heads-outer"])
def test_native_and_torch_write_the_same_pages(kind, dtype):
    layout = layout_for(dtype)
    caches, _ = make_caches(kind, dtype, seed=3)
    with HostArena.create(2 * 8 * layout.page_bytes, mlock=False) as arena:
        BlockCopier(caches, NUM_BLOCKS, layout, arena, method="native").save([5, 1, 8], [0, 2, 4])
        BlockCopier(caches, NUM_BLOCKS, layout, arena, method="torch").save([5, 1, 8], [8, 10, 12])
        pages = arena.array.reshape(-1, layout.page_bytes)
        assert np.array_equal(pages[[0, 2, 4]], pages[[8, 10, 12]])


def test_runs_follow_the_memory_layout():
    f32 = torch.float32
    layout = layout_for(f32)
    cpu, _ = make_caches("cpu", f32, seed=4)
    r = BlockRuns.of(cpu[0])
    assert r is not None and r.run_bytes == layout.layer_page_bytes and r.offsets.tolist() == [0]
    assert r.block_stride == layout.layer_page_bytes and r.address == cpu[0].data_ptr()
    cuda, _ = make_caches("cuda", f32, seed=4)
    r = BlockRuns.of(cuda[0].movedim(1, 0))
    half = BLOCK * HEADS * HEAD * 4
    assert r is not None and r.run_bytes == half and r.offsets.tolist() == [0, NUM_BLOCKS * half]
    outer, _ = make_caches("heads-outer", f32, seed=4)
    r = BlockRuns.of(outer[0])
    assert r is not None and r.run_bytes == BLOCK * 2 * HEAD * 4 and len(r.offsets) == HEADS
    # A last dim that is not contiguous: runs of one element, too short for the native path.
    assert BlockRuns.of(torch.zeros(NUM_BLOCKS, HEADS, 2 * HEAD, BLOCK).transpose(2, 3)) is None
    assert BlockRuns.of(torch.zeros(1, 2 * HEAD).expand(NUM_BLOCKS, 2 * HEAD)) is None  # blocks share memory


def test_auto_picks_native_on_cpu_and_torch_where_it_cannot_run():
    layout = layout_for(torch.float32)
    caches, _ = make_caches("cpu", torch.float32, seed=5)
    transposed = [torch.zeros(NUM_BLOCKS, HEADS, 2 * HEAD, BLOCK).transpose(2, 3) for _ in range(LAYERS)]
    with HostArena.create(8 * layout.page_bytes, mlock=False) as arena:
        assert BlockCopier(caches, NUM_BLOCKS, layout, arena).method == "native"
        assert BlockCopier(transposed, NUM_BLOCKS, layout, arena).method == "torch"
        with pytest.raises(LayoutError, match="runs of"):
            BlockCopier(transposed, NUM_BLOCKS, layout, arena, method="native")
        with pytest.raises(LayoutError, match="copy method"):
            BlockCopier(caches, NUM_BLOCKS, layout, arena, method="memcpy")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["native", "torch"])
def test_bad_ids_copy_nothing(method):
    layout = layout_for(torch.bfloat16)
    with HostArena.create(8 * layout.page_bytes, mlock=False) as arena:
        caches, bufs = make_caches("cuda", torch.bfloat16, seed=6)
        before = [b.clone() for b in bufs]
        arena.array[:] = 0x3C
        c = BlockCopier(caches, NUM_BLOCKS, layout, arena, method=method)
        bad = (([NUM_BLOCKS], [0]), ([0], [8]), ([0, 1], [0]), ([-1], [0]), ([0], [-1]), ([[0]], [[1]]))
        for blocks, pages in bad:
            with pytest.raises(LayoutError):
                c.load_layer(0, blocks, pages)
            with pytest.raises(LayoutError):
                c.save(blocks, pages)
        assert all(torch.equal(a, b) for a, b in zip(bufs, before))
        assert (arena.array == 0x3C).all()


@pytest.mark.parametrize("method", ["native", "torch"])
@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_per_layer_saves_take_each_layers_own_blocks(kind, method):
    """Hybrid models: each layer's KV cache group has its own block for a page."""
    layout = layout_for(torch.float32)
    per_layer = [[3, 8, 1], [12, 0, 5], [7, 7, 2]]  # a block id per page, per layer
    pages = [4, 10, 2]
    with HostArena.create(16 * layout.page_bytes, mlock=False) as arena:
        src, _ = make_caches(kind, torch.float32, seed=3)
        copier = BlockCopier(src, NUM_BLOCKS, layout, arena, method=method)
        for layer, blocks in enumerate(per_layer):
            copier.save_layer(layer, blocks, pages)
        page_view = copier.host[torch.tensor(pages)]
        for layer, t in enumerate(src):
            assert torch.equal(page_view[:, layer], block_bytes(t, kind, per_layer[layer]))
        with pytest.raises(LayoutError):
            copier.save_layer(0, [1, 2], pages)


def test_layers_arranged_differently_save_the_same_pages():
    """The native save builds every layer's chunks in one broadcast where layers differ only
    in address; layers whose blocks lie differently in memory take the per-layer tables."""
    layout = layout_for(torch.float32)
    cpu, _ = make_caches("cpu", torch.float32, seed=9)
    outer, _ = make_caches("heads-outer", torch.float32, seed=10)
    mixed = [cpu[0], outer[1], cpu[2]]  # same logical shape, runs of a block vs of a head
    blocks, pages = [4, 12, 0], [1, 7, 3]
    with HostArena.create(16 * layout.page_bytes, mlock=False) as arena:
        native = BlockCopier(mixed, NUM_BLOCKS, layout, arena, method="native")
        assert native._all_layers is None and BlockCopier(cpu, NUM_BLOCKS, layout, arena)._all_layers is not None
        native.save(blocks, pages)
        BlockCopier(mixed, NUM_BLOCKS, layout, arena, method="torch").save(blocks, [8, 9, 10])
        host = arena.array.reshape(-1, layout.page_bytes)
        assert np.array_equal(host[pages], host[[8, 9, 10]])
        for layer, t in enumerate(mixed):
            assert torch.equal(native.host[torch.tensor(pages)][:, layer], block_bytes(t, "cpu", blocks))


def test_saves_stream_and_loads_stream_by_all_their_layers(monkeypatch):
    """Native path: a save takes streaming stores at any size (nothing here reads the pages
    back); a per-layer load streams once all its layers pass the threshold, though one
    layer does not. Bytes are exact either way."""
    from hicache.kernels import copy as kcopy

    layout = layout_for(torch.float32)
    blocks, pages = [9, 2, 11, 4], [6, 0, 14, 3]
    one_layer = len(blocks) * layout.layer_page_bytes
    monkeypatch.setattr(kcopy, "STREAM_MIN_BYTES", 2 * one_layer)  # above a layer, below all 3
    stores: list[bool] = []  # the flag each native call got (the real copier still runs)
    real = kcopy.ChunkCopier._batch_runner

    def watched(self, src, dst, nbytes, stream):
        stores.append(stream)
        return real(self, src, dst, nbytes, stream)

    monkeypatch.setattr(kcopy.ChunkCopier, "_batch_runner", watched)
    with HostArena.create(16 * layout.page_bytes, mlock=False) as arena:
        src, _ = make_caches("cpu", torch.float32, seed=7)
        copier = BlockCopier(src, NUM_BLOCKS, layout, arena, method="native")
        copier.save(blocks[:1], pages[:1])  # one block, far below the threshold
        copier.save_layer(0, blocks[:1], pages[:1])
        assert stores == [True, True]
        dst, _ = make_caches("cpu", torch.float32, seed=8, zero=True)
        loader = BlockCopier(dst, NUM_BLOCKS, layout, arena, method="native")
        copier.save(blocks, pages)
        stores.clear()
        loader.load_layer(0, blocks, pages)  # alone: one layer's bytes decide
        loader.load_layer(1, blocks, pages, transfer_bytes=LAYERS * one_layer)
        loader.load_layer(2, blocks, pages, transfer_bytes=LAYERS * one_layer)
        assert stores == [False, True, True]
        for s, d in zip(src, dst):
            assert torch.equal(block_bytes(d, "cpu", blocks), block_bytes(s, "cpu", blocks))


# Runs in a fresh interpreter with TRITON_INTERPRET=1 set before Triton is imported.
_INTERPRET_RUNNER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np, torch
    from tests.integrations import test_block_copy as t
    from hicache.integrations.block_copy import BlockCopier
    from hicache.tiers.host.arena import HostArena
    kinds = ("cpu", "cuda", "heads-outer", "token-major")
    for kind in kinds:
        for dtype in (torch.float32, torch.bfloat16):
            t.test_save_then_per_layer_load_is_byte_exact(kind, dtype, "triton")
            layout = t.layout_for(dtype)
            caches, _ = t.make_caches(kind, dtype, seed=3)
            with HostArena.create(2 * 8 * layout.page_bytes, mlock=False) as arena:
                BlockCopier(caches, t.NUM_BLOCKS, layout, arena, method="triton").save([5, 1, 8], [0, 2, 4])
                BlockCopier(caches, t.NUM_BLOCKS, layout, arena, method="torch").save([5, 1, 8], [8, 10, 12])
                pages = arena.array.reshape(-1, layout.page_bytes)
                assert np.array_equal(pages[[0, 2, 4]], pages[[8, 10, 12]]), (kind, dtype)
        t.test_per_layer_saves_take_each_layers_own_blocks(kind, "triton")
    t.test_bad_ids_copy_nothing("triton")
    print("INTERPRETED", len(kinds))
""")


def test_triton_path_under_the_interpreter():
    if not triton_env.triton_installed():
        if os.environ.get("CI"):
            raise AssertionError("triton is not installed (scripts/setup.sh installs it with torch)")
        pytest.skip("triton is not installed")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_RUNNER, str(repo)], capture_output=True,
                          text=True, cwd=repo, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "INTERPRETED 4" in proc.stdout


def test_triton_refused_where_it_cannot_run():
    if triton_env.interpreter_enabled():
        pytest.skip("interpreter mode runs kernels on CPU")
    layout = layout_for(torch.float32)
    caches, _ = make_caches("cpu", torch.float32, seed=5)
    with HostArena.create(8 * layout.page_bytes, mlock=False) as arena:
        with pytest.raises(LayoutError, match="triton block copies cannot run"):
            BlockCopier(caches, NUM_BLOCKS, layout, arena, method="triton")
