"""The native batched chunk copy and the copier's threading: bytes equal a
numpy reference with and without streaming stores, odd sizes and alignments
included; a helper thread that never runs does not hold up a copy; switched off,
the copier falls back to the per-chunk path."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hicache.kernels import copy as kcopy
from hicache.kernels import native_copy
from tests.wait import wait_until

native = native_copy.chunk_copy()
needs_native = pytest.mark.skipif(native is None, reason=f"native copy: {native_copy.unavailable_reason()}")


def _random_chunks(seed: int, n: int, max_bytes: int, buf_bytes: int = 1 << 20):
    """Non-overlapping chunks of random sizes at random (unaligned) offsets."""
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, buf_bytes, dtype=np.uint8)
    dst_buf = np.zeros(buf_bytes, dtype=np.uint8)
    slot = buf_bytes // n
    assert max_bytes < slot
    sizes = rng.integers(0, max_bytes, n)
    s_off = rng.permutation(n) * slot + rng.integers(0, slot - max_bytes, n)
    d_off = rng.permutation(n) * slot + rng.integers(0, slot - max_bytes, n)
    want = np.zeros_like(dst_buf)
    for s, d, k in zip(s_off, d_off, sizes):
        want[d:d + k] = src_buf[s:s + k]
    return (src_buf, dst_buf, want, (src_buf.ctypes.data + s_off).astype(np.int64),
            (dst_buf.ctypes.data + d_off).astype(np.int64), sizes.astype(np.int64))


@needs_native
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_bytes", [300, 5000])
def test_native_copy_matches_numpy(stream, max_bytes):
    src_buf, dst_buf, want, s, d, n = _random_chunks(max_bytes, 100, max_bytes)
    native.copy(s, d, n, stream)
    assert np.array_equal(dst_buf, want)
    assert dst_buf.any()


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_copier_paths_match_numpy(use_native, threads):
    if use_native and native is None:
        pytest.skip("no native copy here")
    src_buf, dst_buf, want, s, d, n = _random_chunks(threads, 200, 4000)
    copier = kcopy.ChunkCopier(threads, min_split_bytes=1, min_chunk_bytes=1, native=use_native)
    assert copier.is_native == use_native
    copier.copy(s, d, n)
    copier.close()
    assert np.array_equal(dst_buf, want)


def test_copy_does_not_wait_for_a_helper_that_never_comes():
    """The helper is stuck elsewhere; the caller copies every batch itself and returns."""
    src_buf, dst_buf, want, s, d, n = _random_chunks(7, 64, 4000)
    copier = kcopy.ChunkCopier(2, min_split_bytes=1, min_chunk_bytes=1)
    copier.copy(s[:1], d[:1], n[:1])  # starts nothing yet: one chunk is one batch
    release = threading.Event()
    copier.copy(s[:2], d[:2], n[:2])  # starts the helper pool
    assert copier._pool is not None
    copier._pool.submit(release.wait)  # the only helper is now busy until released
    done = threading.Event()
    t = threading.Thread(target=lambda: (copier.copy(s, d, n), done.set()), daemon=True)
    t.start()
    try:
        wait_until(done.is_set, what="a copy whose helper is busy")
    finally:
        release.set()
    copier.close()
    assert np.array_equal(dst_buf, want)


def test_a_failing_batch_raises_in_the_caller():
    copier = kcopy.ChunkCopier(2, min_split_bytes=1, min_chunk_bytes=1)

    def boom(a: int, b: int) -> None:
        raise RuntimeError("copy failed")

    copier._batch_runner = lambda *args, **kw: boom
    with pytest.raises(RuntimeError, match="copy failed"):
        copier.copy(np.arange(4, dtype=np.int64) * 100, np.arange(4, dtype=np.int64) * 100 + 1000,
                    np.full(4, 10, dtype=np.int64))
    copier.close()


def test_disabled_falls_back(monkeypatch):
    """(Where the library was not built, tests/kernels/test_native_build.py.)"""
    monkeypatch.setenv("HICACHE_NATIVE_COPY", "0")
    native_copy.reset()
    try:
        assert native_copy.chunk_copy() is None
        assert native_copy.unavailable_reason() == "disabled by HICACHE_NATIVE_COPY=0"
    finally:
        monkeypatch.delenv("HICACHE_NATIVE_COPY")
        native_copy.reset()


@needs_native
@pytest.mark.parametrize("name", ["mha-fp16", "mha-fp8-odd", "mla-fp16"])
def test_streaming_page_copies_equal_the_twin(monkeypatch, name):
    """Every copy streams (the threshold is a size, so force it): pages still match."""
    from tests.kernels.test_copy_kernels import LAYOUTS, _compare_backends
    monkeypatch.setattr(kcopy, "STREAM_MIN_BYTES", 0)
    _compare_backends(LAYOUTS[name], 13, ("memcpy", "torch"))


def test_streaming_is_chosen_by_the_whole_transfer(monkeypatch):
    """A per-layer load streams when all its layers together pass the threshold."""
    monkeypatch.setattr(kcopy, "STREAM_MIN_BYTES", 1 << 20)
    assert not kcopy.use_streaming(64 << 10)
    assert kcopy.use_streaming(1 << 20)
    assert kcopy.use_streaming(64 << 10, transfer_bytes=32 * (64 << 10))  # 32 layers of 64 KiB
    assert not kcopy.use_streaming(16 << 10, transfer_bytes=32 * (16 << 10))


@needs_native
def test_layer_loads_of_a_large_plan_stream_and_match_the_twin(monkeypatch):
    """The threshold between one layer's bytes and the whole plan's: every layer
    streams, and the pages still match the twin."""
    from tests.kernels.test_copy_kernels import LAYOUTS, _compare_backends
    layout = LAYOUTS["mha-fp16"]
    threshold = 13 * layout.page_bytes // 2  # one layer of 13 pages below it, all layers above
    assert 13 * layout.layer_page_bytes < threshold
    monkeypatch.setattr(kcopy, "STREAM_MIN_BYTES", threshold)
    _compare_backends(layout, 13, ("memcpy", "torch"))


@pytest.mark.parametrize("perm,index", [((0, 1, 2, 3), 2), ((2, 0, 1, 3), 1), ((1, 3, 0, 2), 0)])
def test_strided_pages_copy_to_flat_pages_in_c_order(perm, index):
    """Pages that are strided views (a layer-first pool's page) go to flat pages in
    the byte order of ``page.flatten()`` and come back unchanged."""
    buf = torch.arange(4 * 6 * 5 * 8, dtype=torch.int16).reshape(4, 6, 5, 8).permute(*perm)
    pages = buf.movedim(index, 0)  # pages[p]: a view, in general not contiguous
    offsets, run = kcopy.strided_runs(pages[0])
    assert run % pages.element_size() == 0 and len(offsets) * run == pages[0].numel() * pages.element_size()
    ids = np.array([3, 0, 2][:pages.shape[0]], dtype=np.int64) % pages.shape[0]
    flat = torch.zeros(len(ids), pages[0].numel(), dtype=torch.int16)
    page_ptrs = pages.data_ptr() + ids * pages.stride(0) * pages.element_size()
    flat_ptrs = flat.data_ptr() + np.arange(len(ids), dtype=np.int64) * flat.stride(0) * flat.element_size()
    strided, dense, nbytes = kcopy.page_run_chunks(page_ptrs, offsets, run, flat_ptrs)
    kcopy.ChunkCopier().copy(strided, dense, nbytes)
    for i, p in enumerate(ids.tolist()):
        assert torch.equal(flat[i], pages[p].flatten())
    back = torch.zeros_like(buf)  # the same strides as buf
    assert back.stride() == buf.stride()
    back_pages = back.movedim(index, 0)
    back_ptrs = back_pages.data_ptr() + ids * back_pages.stride(0) * back_pages.element_size()
    strided, dense, nbytes = kcopy.page_run_chunks(back_ptrs, offsets, run, flat_ptrs)
    kcopy.ChunkCopier().copy(dense, strided, nbytes)
    for p in ids.tolist():
        assert torch.equal(back_pages[p], pages[p])


@needs_native
def test_dirty_pages_changes_no_byte_even_while_another_thread_writes():
    """An engine's pre-fault marks pages written with an atomic add of zero: the bytes stay,
    and a write another thread makes meanwhile is never undone."""
    page = 4096
    buf = np.random.default_rng(3).integers(0, 256, 64 * page, dtype=np.uint8)
    want = buf.copy()
    native.dirty_pages(buf.ctypes.data, buf.nbytes, page)
    assert np.array_equal(buf, want)
    stop = threading.Event()

    def writer() -> None:
        for value in range(1, 200):
            buf[::page] = value
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    while not stop.is_set():
        native.dirty_pages(buf.ctypes.data, buf.nbytes, page)
    t.join()
    assert (buf[::page] == 199).all()
    mask = np.ones(buf.size, dtype=bool)
    mask[::page] = False
    assert np.array_equal(buf[mask], want[mask])
