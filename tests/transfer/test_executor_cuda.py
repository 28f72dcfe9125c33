"""The CUDA path of the transfer executor (`gpu` marker; skipped without CUDA):
the arena is registered while served and unregistered on close, loads go on a
side stream with one event per layer that the compute stream waits on (no host
synchronization), backups are ordered after the compute that wrote the pages,
completion is polled, and the bytes survive device -> host -> device exactly,
with the copy kernel, the twin, and DMA runs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hicache.kernels import copy_triton
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostKVCache
from hicache.transfer.executor import CudaBackupHandle, CudaLoadHandle, TransferExecutor
from tests.kv_pages import random_pool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYOUTS = {
    "mha-fp16": KVLayout("mha", 8, 16, "float16", num_kv_heads=8, head_dim=128),
    "mha-bf16-ps64": KVLayout("mha", 4, 64, "bfloat16", num_kv_heads=4, head_dim=128),
    "mla-fp8": KVLayout("mla", 4, 16, "float8_e4m3fn", kv_lora_rank=512, qk_rope_head_dim=64),
}
BACKENDS = [("triton", None), ("torch", None), (None, 4)]  # (backend, dma_min_run_pages)


def poll(done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the copy never completed")
        time.sleep(0.001)


def queue_slow_work() -> None:
    """Some tens of milliseconds of matmuls on the current stream, so work queued
    after them is still pending when the next call is made."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x / 64


def make_cache(layout: KVLayout, arena: HostArena, backend: str | None, min_run: int | None) -> HostKVCache:
    if backend == "triton" and not copy_triton.triton_usable(torch.device("cuda")):
        pytest.skip("triton is not usable here")
    return HostKVCache(layout, arena, backend=backend, dma_min_run_pages=min_run)


@pytest.mark.parametrize("backend,min_run", BACKENDS, ids=["triton", "torch", "dma"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_through_the_streams_is_exact(name, backend, min_run):
    layout = LAYOUTS[name]
    n = 40
    src = random_pool(layout, 64, seed=1, device="cuda")
    arena = HostArena.create(64 * layout.page_bytes, mlock=False)
    cache = make_cache(layout, arena, backend, min_run)
    rng = np.random.default_rng(0)
    host = np.concatenate([np.arange(3, 15), rng.choice(np.arange(20, 64), n - 12, replace=False)])
    dev = np.concatenate([np.arange(30, 42), rng.choice(np.arange(1, 30), n - 12, replace=False)])
    back = rng.permutation(np.arange(1, 65))[:n]
    with TransferExecutor(cache, src) as ex:
        assert arena.cuda_registered
        b = ex.backup(host, dev)
        assert isinstance(b, CudaBackupHandle)
        poll(b.done)
        dst = DevicePool(layout, 64 * layout.page_size, device="cuda")
        ex2 = TransferExecutor(cache, dst)
        h = ex2.load(host, back)
        assert isinstance(h, CudaLoadHandle)
        out = []
        for layer in range(layout.num_layers):
            h.wait_layer(layer)  # the compute stream waits; the host does not
            bufs = [dst.k_buffers[layer]] + ([dst.v_buffers[layer]] if dst.v_buffers else [])
            out.append([x.view(torch.uint8).reshape(dst.num_pages + 1, -1)[torch.as_tensor(back, device="cuda")]
                        .clone() for x in bufs])
        torch.cuda.current_stream().synchronize()
        assert h.done()
        for layer in range(layout.num_layers):
            for which, got in enumerate(out[layer]):
                assert torch.equal(got, _layer_bytes(src, layer, which, dev)), (layer, which)
        ex2.close()
    cache.close()
    arena.close()
    assert not arena.cuda_registered


def _layer_bytes(pool: DevicePool, layer: int, which: int, ids: np.ndarray) -> torch.Tensor:
    buf = (pool.k_buffers if which == 0 else pool.v_buffers)[layer]
    return buf.view(torch.uint8).reshape(pool.num_pages + 1, -1)[torch.as_tensor(ids, device=pool.device)]


def test_backup_is_ordered_after_the_compute_that_wrote_the_pages():
    layout = LAYOUTS["mha-fp16"]
    pool = DevicePool(layout, 64 * layout.page_size, device="cuda")
    arena = HostArena.create(64 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    ids = np.arange(1, 33)
    with TransferExecutor(cache, pool) as ex:
        # Queue slow work, then the writes, on the compute stream; backup right away.
        queue_slow_work()
        for layer in range(layout.num_layers):
            pool.k_buffers[layer][16:33 * 16] = 1.0 + layer
            pool.v_buffers[layer][16:33 * 16] = -1.0 - layer
        b = ex.backup(np.arange(32), ids)
        poll(b.done)
    for slot in range(32):
        page = np.frombuffer(cache.read_page(slot), dtype=np.float16).reshape(layout.num_layers, 2, -1)
        for layer in range(layout.num_layers):
            assert (page[layer, 0] == 1.0 + layer).all() and (page[layer, 1] == -1.0 - layer).all()
    cache.close()
    arena.close()


def test_load_is_ordered_after_compute_that_released_the_pages():
    layout = LAYOUTS["mha-fp16"]
    src = random_pool(layout, 16, seed=2, device="cuda")
    arena = HostArena.create(16 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    with TransferExecutor(cache, src) as ex:
        poll(ex.backup(np.arange(8), np.arange(1, 9)).done)
        dst = DevicePool(layout, 16 * layout.page_size, device="cuda")
        with TransferExecutor(cache, dst) as ex2:
            queue_slow_work()
            for buf in dst.k_buffers + dst.v_buffers:
                buf.fill_(7.0)  # a late write by the previous owner of the pages
            h = ex2.load(np.arange(8), np.arange(1, 9))
            h.wait()
    for layer in range(layout.num_layers):
        for which in (0, 1):
            assert torch.equal(_layer_bytes(dst, layer, which, np.arange(1, 9)),
                               _layer_bytes(src, layer, which, np.arange(1, 9)))
    cache.close()
    arena.close()


def test_layers_complete_in_order_and_are_polled():
    layout = LAYOUTS["mha-fp16"]
    src = random_pool(layout, 512, seed=3, device="cuda")
    arena = HostArena.create(512 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    with TransferExecutor(cache, src) as ex:
        poll(ex.backup(np.arange(500), np.arange(1, 501)).done)
        h = ex.load(np.arange(500), np.arange(1, 501)[::-1].copy())
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < layout.num_layers and time.monotonic() < deadline:
            ready = [layer for layer in range(layout.num_layers) if h.layer_ready(layer)]
            assert ready == list(range(len(ready)))  # a prefix of the layers, never a gap
            seen = ready
        assert len(seen) == layout.num_layers and h.done()
    cache.close()
    arena.close()


def test_cuda_pool_picks_the_triton_backend_when_it_can():
    layout = LAYOUTS["mha-fp16"]
    arena = HostArena.create(4 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    pool = DevicePool(layout, 4 * layout.page_size, device="cuda")
    cache.prepare(pool, [0], [1])
    assert cache.backend == ("triton" if copy_triton.triton_usable(torch.device("cuda")) else "torch")
    with pytest.raises(Exception, match="serves cuda pools"):
        cache.prepare(DevicePool(layout, 4 * layout.page_size), [0], [1])
    cache.close()
    arena.close()
