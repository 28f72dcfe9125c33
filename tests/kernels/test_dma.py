"""Strided DMA copies for runs of consecutive pages: run detection, the 2-D copy
descriptors (executed on CPU as row memmoves, byte for byte against the torch
twin), HostKVCache mixing DMA runs with the backend, and cudaMemcpy2DAsync on
CUDA under the `gpu` marker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.errors import LayoutError
from hicache.kernels import dma
from hicache.kernels import copy as kcopy
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostKVCache
from tests.kv_pages import random_pool

LAYOUTS = {
    "mha": KVLayout("mha", 3, 4, "bfloat16", num_kv_heads=2, head_dim=8, v_head_dim=4),
    "mla": KVLayout("mla", 3, 4, "float16", kv_lora_rank=16, qk_rope_head_dim=8),
    "mha-fp8-odd": KVLayout("mha", 2, 3, "float8_e4m3fn", num_kv_heads=1, head_dim=3, v_head_dim=5),
    "mla-1-layer": KVLayout("mla", 1, 4, "float16", kv_lora_rank=16, qk_rope_head_dim=8),
}


def ids(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_find_runs_splits_where_either_side_breaks():
    runs = dma.find_runs(ids([4, 5, 6, 9, 10, 0, 1, 2, 3]), ids([1, 2, 3, 4, 5, 7, 8, 20, 21]))
    assert runs.host.tolist() == [4, 9, 0, 2]
    assert runs.device.tolist() == [1, 4, 7, 20]
    assert runs.length.tolist() == [3, 2, 2, 2]
    assert runs.pages == 9 and len(runs) == 4


def test_find_runs_edges():
    assert len(dma.find_runs(ids([]), ids([]))) == 0
    one = dma.find_runs(ids([7]), ids([3]))
    assert (one.host.tolist(), one.device.tolist(), one.length.tolist()) == ([7], [3], [1])
    # descending ids never form a run
    assert dma.find_runs(ids([3, 2, 1]), ids([3, 2, 1])).length.tolist() == [1, 1, 1]


def test_split_long_runs_keeps_short_ones_for_the_kernel():
    h, d = ids([4, 5, 6, 9, 10, 0, 1, 2, 3]), ids([1, 2, 3, 4, 5, 7, 8, 20, 21])
    runs, rest = dma.split_long_runs(h, d, 3)
    assert runs.host.tolist() == [4] and runs.length.tolist() == [3]
    assert h[rest].tolist() == [9, 10, 0, 1, 2, 3]
    runs, rest = dma.split_long_runs(h, d, 1)
    assert runs.pages == 9 and not rest.any()


def test_descriptors_cover_each_page_chunk_once():
    layout = LAYOUTS["mha"]
    g = kcopy.PageGeometry.from_layout(layout)
    runs = dma.find_runs(ids([2, 3, 4, 8]), ids([5, 6, 7, 1]))
    c = dma.load_layer_copies(1000, 10**6, 2 * 10**6, runs, 1, g)
    assert len(c) == 4  # (2 runs) x (K, V)
    assert c.nbytes == 4 * (g.k_bytes + g.v_bytes)
    assert c.src[0] == 1000 + 2 * g.page_bytes + g.layer_bytes and c.spitch[0] == g.page_bytes
    assert c.dst[0] == 10**6 + 5 * g.k_bytes and c.dpitch[0] == g.k_bytes and c.height[0] == 3
    b = dma.backup_copies(1000, ids([10**6, 3 * 10**6, 5 * 10**6]), ids([2 * 10**6, 4 * 10**6, 6 * 10**6]),
                          runs, g)
    assert len(b) == 2 * 3 * 2 and b.nbytes == 4 * g.page_bytes


def round_trip(layout: KVLayout, backend: str, min_run: int | None, host: list[int], dev: list[int],
               back: list[int], device: str = "cpu") -> tuple[bytes, list[torch.Tensor]]:
    """Backup `dev` pages into `host` slots, load them into `back` pages of a fresh
    pool; returns the arena bytes and the fresh pool's raw buffers."""
    n = max(max(dev), max(back)) + 1
    src = random_pool(layout, n, seed=11, device=device)
    arena = HostArena.create((max(host) + 2) * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena, backend=backend, dma_min_run_pages=min_run)
    try:
        cache.backup_from_device_all_layer(src, host, dev)
        dst = DevicePool(layout, n * layout.page_size, device=device)
        for layer in range(layout.num_layers):
            cache.load_to_device_per_layer(dst, host, back, layer)
        if device == "cuda":
            torch.cuda.synchronize()
        out = [b.view(torch.uint8).cpu().clone() for b in dst.k_buffers + dst.v_buffers]
        return bytes(arena.array), out
    finally:
        cache.close()
        arena.close()


# Runs of 4 and 3 pages, a broken run, singles; destinations shuffled differently.
HOST = [0, 1, 2, 3, 9, 10, 11, 5, 6, 20, 14]
DEV = [3, 4, 5, 6, 10, 11, 12, 1, 9, 20, 15]
BACK = [7, 8, 9, 10, 1, 2, 3, 4, 5, 19, 16]


@pytest.mark.parametrize("min_run", [1, 3, 4])
@pytest.mark.parametrize("backend", ["memcpy", "torch"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dma_runs_plus_backend_equal_the_twin_alone(name, backend, min_run):
    layout = LAYOUTS[name]
    ref = round_trip(layout, "torch", None, HOST, DEV, BACK)
    got = round_trip(layout, backend, min_run, HOST, DEV, BACK)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_plan_counts_dma_and_backend_pages():
    layout = LAYOUTS["mha"]
    arena = HostArena.create(32 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena, dma_min_run_pages=3)
    pool = DevicePool(layout, 32 * layout.page_size)
    plan = cache.prepare(pool, HOST, DEV)
    assert len(plan) == len(HOST)
    assert plan.runs is not None and plan.runs.length.tolist() == [4, 3]
    assert plan.host_np.tolist() == [5, 6, 20, 14]
    scattered = cache.prepare(pool, [5, 1], [2, 9])
    assert scattered.runs is None and len(scattered) == 2
    cache.close()
    arena.close()


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_bad_dma_min_run_is_refused(bad):
    layout = LAYOUTS["mha"]
    arena = HostArena.create(4 * layout.page_bytes, mlock=False)
    with pytest.raises(LayoutError, match="dma_min_run_pages"):
        HostKVCache(layout, arena, dma_min_run_pages=bad)
    arena.close()


def test_no_cudart_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    dma.cuda_runtime.cache_clear()
    with pytest.raises(dma.DmaUnavailable):
        dma.cuda_runtime()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("min_run", [1, 3])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cuda_dma_runs_equal_the_twin(name, backend, min_run):
    from hicache.kernels import copy_triton

    if backend == "triton" and not copy_triton.triton_usable(torch.device("cuda")):
        pytest.skip("triton is not usable here")
    layout = LAYOUTS[name]
    ref = round_trip(layout, "torch", None, HOST, DEV, BACK, device="cuda")
    got = round_trip(layout, backend, min_run, HOST, DEV, BACK, device="cuda")
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


@pytest.mark.gpu
@cuda
def test_cuda_dma_large_run_on_a_side_stream():
    layout = KVLayout("mha", 4, 16, "float16", num_kv_heads=8, head_dim=128)
    n = 512
    src = random_pool(layout, n, seed=3, device="cuda")  # pages 1..n (page 0 is padding)
    arena = HostArena.create(n * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena, dma_min_run_pages=8)
    stream = torch.cuda.Stream()
    # The pools are filled on the default stream: the side stream must wait for that, as the
    # executor's streams do (TransferExecutor waits on the step's stream before each copy).
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cache.backup_from_device_all_layer(src, np.arange(n), np.arange(1, n + 1))
    stream.synchronize()
    dst = DevicePool(layout, n * layout.page_size, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())  # dst's zero fill
    with torch.cuda.stream(stream):
        for layer in range(layout.num_layers):
            cache.load_to_device_per_layer(dst, np.arange(n), np.arange(1, n + 1), layer)
    stream.synchronize()
    for a, b in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
        assert torch.equal(a[layout.page_size:].view(torch.uint8), b[layout.page_size:].view(torch.uint8))
    cache.close()
    arena.close()
