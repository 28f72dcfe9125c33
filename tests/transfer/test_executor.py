"""TransferExecutor on CPU pools: asynchronous per-layer loads with in-order
layer completion, backups, error propagation, shutdown."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hicache.errors import HiCacheError
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostCacheError, HostKVCache
from hicache.transfer.executor import BackupHandle, LoadHandle, TransferError, TransferExecutor
from tests.kv_pages import random_pool
from tests.wait import wait_until

LAYOUT = KVLayout("mha", 6, 4, "bfloat16", num_kv_heads=2, head_dim=16)


def page(pool: DevicePool, layer: int, p: int) -> list[torch.Tensor]:
    ps = pool.page_size
    bufs = [pool.k_buffers[layer]] + ([pool.v_buffers[layer]] if pool.v_buffers else [])
    return [b[p * ps:(p + 1) * ps].view(torch.uint8) for b in bufs]


@pytest.fixture
def setup():
    arena = HostArena.create(16 * LAYOUT.page_bytes, mlock=False)
    cache = HostKVCache(LAYOUT, arena)
    src = random_pool(LAYOUT, 16, seed=0)
    yield arena, cache, src
    cache.close()
    arena.close()


def test_backup_then_load_round_trips(setup):
    arena, cache, src = setup
    with TransferExecutor(cache, src) as ex:
        b = ex.backup(np.array([3, 9, 1]), np.array([4, 5, 16]))
        assert isinstance(b, BackupHandle)
        b.wait()
        assert b.done()
    dst = random_pool(LAYOUT, 16, seed=1)
    with TransferExecutor(cache, dst) as ex:
        h = ex.load(torch.tensor([3, 9, 1]), [2, 7, 8])
        assert isinstance(h, LoadHandle)
        for layer in range(LAYOUT.num_layers):
            h.wait_layer(layer)
            for s, d in ((4, 2), (5, 7), (16, 8)):
                assert all(torch.equal(a, b) for a, b in zip(page(src, layer, s), page(dst, layer, d)))
        h.wait()
        assert h.done()


def test_jobs_run_in_submission_order(setup):
    # A backup followed by a load of the same host slots: the load sees the backup.
    arena, cache, src = setup
    dst = DevicePool(LAYOUT, 16 * LAYOUT.page_size)
    with TransferExecutor(cache, src) as ex_src, TransferExecutor(cache, dst) as ex_dst:
        b = ex_src.backup([0, 1], [10, 11])
        b.wait()
        handles = [ex_dst.load([0, 1], [p, p + 1]) for p in (1, 3, 5)]
    for h in handles:
        assert h.done()
    for layer in range(LAYOUT.num_layers):
        for d in (1, 3, 5):
            assert all(torch.equal(a, b) for a, b in zip(page(src, layer, 10), page(dst, layer, d)))


def test_wait_layer_returns_before_later_layers_are_copied(setup):
    # The worker is held right after layer 0 is in place: wait_layer(0) must return
    # while the last layer has not been copied yet. No timing involved.
    arena, cache, src = setup
    cache.backup_from_device_all_layer(src, [0, 1, 2], [1, 2, 3])
    dst = DevicePool(LAYOUT, 16 * LAYOUT.page_size)
    gate = threading.Event()
    order: list[int] = []

    def hook(layer: int) -> None:
        order.append(layer)
        if layer == 0:
            assert gate.wait(30)

    ex = TransferExecutor(cache, dst, on_layer_done=hook)
    h = ex.load([0, 1, 2], [4, 5, 6])
    h.wait_layer(0)
    assert all(torch.equal(a, b) for a, b in zip(page(src, 0, 1), page(dst, 0, 4)))
    last = LAYOUT.num_layers - 1
    assert not h.layer_ready(last) and not h.done()
    assert not page(dst, last, 4)[0].any()  # really not copied yet
    gate.set()
    h.wait()
    assert order == list(range(LAYOUT.num_layers))
    assert all(h.layer_ready(layer) for layer in range(LAYOUT.num_layers))
    assert all(torch.equal(a, b) for a, b in zip(page(src, last, 1), page(dst, last, 4)))
    ex.close()


def test_layer_events_are_set_in_layer_order(setup):
    arena, cache, src = setup
    seen: list[list[bool]] = []
    ex = TransferExecutor(cache, src)
    h: LoadHandle | None = None

    def hook(layer: int) -> None:
        # Called after layer `layer` is in place: exactly layers 0..layer are ready.
        assert h is not None
        seen.append([h.layer_ready(x) for x in range(LAYOUT.num_layers)])

    ex.on_layer_done = hook
    started = threading.Event()
    ex._submit(started.wait)  # hold the worker until `h` is bound
    h = ex.load(list(range(8)), list(range(1, 9)))
    started.set()
    h.wait()
    ex.close()
    n = LAYOUT.num_layers
    assert seen == [[x <= layer for x in range(n)] for layer in range(n)]


def test_worker_exception_propagates_to_waiters(setup):
    arena, cache, src = setup
    boom = RuntimeError("copy engine fell over")

    def hook(layer: int) -> None:
        if layer == 2:
            raise boom

    ex = TransferExecutor(cache, src, on_layer_done=hook)
    h = ex.load([0, 1], [1, 2])
    h.wait_layer(0)  # in place before the failure
    h.wait_layer(2)  # layer 2 itself was copied; the failure hit after it
    with pytest.raises(TransferError) as err:
        h.wait_layer(3)
    assert err.value.__cause__ is boom
    with pytest.raises(TransferError):
        h.wait()
    assert h.done()
    # The worker survives: later jobs still run.
    ex.on_layer_done = None
    h2 = ex.load([0, 1], [1, 2])
    h2.wait()
    ex.close()


def test_backup_failure_propagates(setup):
    arena, cache, src = setup
    ex = TransferExecutor(cache, src)
    gate = threading.Event()
    ex._submit(gate.wait)  # hold the worker
    b = ex.backup([0], [1])
    arena.close()  # the copy then finds the arena gone
    gate.set()
    with pytest.raises(TransferError) as err:
        b.wait()
    assert isinstance(err.value.__cause__, HiCacheError) and "closed" in str(err.value.__cause__)
    assert b.done()
    ex.close()


def test_bad_ids_raise_at_submit_and_copy_nothing(setup):
    arena, cache, src = setup
    before = arena.array.copy()
    with TransferExecutor(cache, src) as ex:
        with pytest.raises(HostCacheError):
            ex.backup([0, 16], [1, 2])
        with pytest.raises(HostCacheError):
            ex.load([0], [0])
        with pytest.raises(HostCacheError):
            ex.load([0, 1], [1])
    assert np.array_equal(arena.array, before)


def test_empty_plans_complete_immediately(setup):
    arena, cache, src = setup
    ex = TransferExecutor(cache, src)
    gate = threading.Event()
    ex._submit(gate.wait)  # a busy worker must not delay empty plans
    h = ex.load([], [])
    assert h.done()
    h.wait_layer(LAYOUT.num_layers - 1)
    h.wait()
    b = ex.backup(np.empty(0, np.int64), np.empty(0, np.int64))
    assert b.done()
    b.wait()
    gate.set()
    ex.close()


def test_close_finishes_queued_jobs_and_is_idempotent(setup):
    arena, cache, src = setup
    ex = TransferExecutor(cache, src)
    gate = threading.Event()
    ex._submit(gate.wait)
    b = ex.backup(list(range(16)), list(range(1, 17)))
    h = ex.load([0], [1])
    assert not b.done() and not h.done()
    gate.set()
    ex.close()
    assert b.done() and h.done()
    b.wait()
    h.wait()
    ex.close()
    with pytest.raises(HiCacheError, match="closed"):
        ex.load([0], [1])
    with pytest.raises(HiCacheError, match="closed"):
        ex.backup([0], [1])


def test_wait_idle_returns_once_every_submitted_copy_is_done(setup):
    # The worker is held by a gate; it opens only once wait_idle's marker is queued behind
    # the backup and the load, so wait_idle must have waited for both.
    arena, cache, src = setup
    ex = TransferExecutor(cache, src)
    gate = threading.Event()
    ex._submit(gate.wait)
    b = ex.backup(list(range(16)), list(range(1, 17)))
    h = ex.load([0], [1])

    def open_gate() -> None:
        wait_until(lambda: ex._jobs.qsize() >= 3, 30, "wait_idle's marker behind the copies")
        gate.set()

    opener = threading.Thread(target=open_gate)
    opener.start()
    ex.wait_idle()
    assert b.done() and h.done()
    opener.join()
    ex.close()
    ex.wait_idle()  # closed: close() already ran every job


def test_wait_layer_out_of_range(setup):
    arena, cache, src = setup
    with TransferExecutor(cache, src) as ex:
        h = ex.load([0], [1])
        with pytest.raises(HiCacheError):
            h.wait_layer(LAYOUT.num_layers)
        h.wait()


def test_mismatched_pool_layout_rejected(setup):
    arena, cache, src = setup
    other = DevicePool(KVLayout("mha", 6, 4, "float16", num_kv_heads=2, head_dim=16), 16)
    with pytest.raises(HiCacheError):
        TransferExecutor(cache, other)


def test_big_load_is_correct_across_threads():
    # Enough bytes per layer that the memcpy path splits over threads.
    layout = KVLayout("mha", 4, 64, "float16", num_kv_heads=8, head_dim=128)  # 128 KiB K blocks
    arena = HostArena.create(48 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena, copy_threads=2)
    src = random_pool(layout, 48, seed=2)
    dst = DevicePool(layout, 48 * layout.page_size)
    rng = np.random.default_rng(0)
    host = rng.permutation(48)[:40]
    dev = rng.permutation(np.arange(1, 49))[:40]
    with TransferExecutor(cache, src) as ex_src, TransferExecutor(cache, dst) as ex_dst:
        ex_src.backup(host, dev).wait()
        ex_dst.load(host, dev).wait()
    for a, b in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
        rows = torch.from_numpy(np.sort(dev))
        ps = layout.page_size
        idx = (rows[:, None] * ps + torch.arange(ps)).reshape(-1)
        assert torch.equal(a[idx].view(torch.uint8), b[idx].view(torch.uint8))
    cache.close()
    arena.close()
