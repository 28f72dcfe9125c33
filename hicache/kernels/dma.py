"""Strided DMA copies for runs of consecutive pages: the copy engine instead of
a kernel, where a plan has long runs.

A run is `k` consecutive host slots `h .. h+k-1` paired with consecutive device
pages `d .. d+k-1` (the daemon hands out host slots, and engines device pages,
mostly in such runs). In the page-first host layout one layer's K chunks of a
run sit a page apart (pitch `page_bytes`) while in the pool they are back to
back (pitch `k_bytes`): one 2-D copy moves all of them. On CUDA that is
`cudaMemcpy2DAsync`, run by the copy engine: no SMs taken from the compute the
load overlaps with, and one API call per (run, layer, K/V) instead of one per
page. On CPU pools the same descriptors run as one `memmove` per row, which is
how the tests check the address arithmetic without a GPU.

Which pages go this way is the caller's choice (`HostKVCache(dma_min_run_pages=...)`):
the copy kernel wins on scattered pages, DMA on long runs; the crossover is
what `hicache bench transfer --device cuda` measures.

cudart is reached through ctypes in the copy of libcudart that torch loaded
(found in /proc/self/maps), so streams and the primary context are shared
with torch; no extension to build.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass

import numpy as np

from hicache.errors import HiCacheError
from hicache.kernels.copy import PageGeometry


class DmaUnavailable(HiCacheError):
    """cudart's 2-D copy cannot be reached in this process."""


@dataclass(frozen=True, slots=True)
class Runs:
    """Maximal runs of consecutive (host slot, device page) pairs."""

    host: np.ndarray  # int64, first host slot of each run
    device: np.ndarray  # int64, first device page of each run
    length: np.ndarray  # int64, pages in each run

    @property
    def pages(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


def find_runs(host_pages: np.ndarray, device_pages: np.ndarray) -> Runs:
    """Split page pairs, in their given order, into maximal runs where both ids
    step by +1."""
    n = len(host_pages)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    breaks = (np.diff(host_pages) != 1) | (np.diff(device_pages) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    length = np.diff(np.append(starts, n))
    return Runs(host_pages[starts].astype(np.int64), device_pages[starts].astype(np.int64),
                length.astype(np.int64))


def split_long_runs(host_pages: np.ndarray, device_pages: np.ndarray,
                    min_run: int) -> tuple[Runs, np.ndarray]:
    """(runs of at least `min_run` pages, mask of the pages left for the kernel)."""
    runs = find_runs(host_pages, device_pages)
    long = runs.length >= min_run
    per_page_long = np.repeat(long, runs.length)
    return Runs(runs.host[long], runs.device[long], runs.length[long]), ~per_page_long


@dataclass(frozen=True, slots=True)
class Copies2D:
    """2-D copies as parallel arrays: `height` rows of `width` bytes, row `r` from
    `src + r * spitch` to `dst + r * dpitch`."""

    dst: np.ndarray
    dpitch: np.ndarray
    src: np.ndarray
    spitch: np.ndarray
    width: np.ndarray
    height: np.ndarray

    def __len__(self) -> int:
        return len(self.dst)

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())


def _stack(parts: list[tuple[np.ndarray, int, np.ndarray, int, int]], height: np.ndarray) -> Copies2D:
    """`parts`: (dst, dpitch, src, spitch, width) per K/V (and layer), each over the runs."""
    n = len(height)

    def column(i: int) -> np.ndarray:
        return np.concatenate([np.broadcast_to(np.asarray(p[i], dtype=np.int64), (n,)) for p in parts])

    return Copies2D(*(column(i) for i in range(5)), height=np.tile(height, len(parts)))


def load_layer_copies(host_base: int, k_ptr: int, v_ptr: int | None, runs: Runs, layer: int,
                      geom: PageGeometry) -> Copies2D:
    """One layer of every run, host -> device: K (and V) rows one page apart on the
    host, back to back in the pool."""
    h = host_base + runs.host * geom.page_bytes + layer * geom.layer_bytes
    parts = [(k_ptr + runs.device * geom.k_bytes, geom.k_bytes, h, geom.page_bytes, geom.k_bytes)]
    if v_ptr is not None:
        parts.append((v_ptr + runs.device * geom.v_bytes, geom.v_bytes, h + geom.k_bytes, geom.page_bytes,
                      geom.v_bytes))
    return _stack(parts, runs.length)


def backup_copies(host_base: int, k_ptrs: np.ndarray, v_ptrs: np.ndarray | None, runs: Runs,
                  geom: PageGeometry) -> Copies2D:
    """Every layer of every run, device -> host."""
    h = host_base + runs.host * geom.page_bytes
    parts = []
    for layer in range(geom.num_layers):
        hl = h + layer * geom.layer_bytes
        parts.append((hl, geom.page_bytes, int(k_ptrs[layer]) + runs.device * geom.k_bytes, geom.k_bytes,
                      geom.k_bytes))
        if v_ptrs is not None:
            parts.append((hl + geom.k_bytes, geom.page_bytes, int(v_ptrs[layer]) + runs.device * geom.v_bytes,
                          geom.v_bytes, geom.v_bytes))
    return _stack(parts, runs.length)


# ---------------------------------------------------------------------------
# Runners
# ---------------------------------------------------------------------------

def run_on_cpu(copies: Copies2D) -> None:
    """Each row as one memmove (ctypes releases the GIL for the copy)."""
    for dst, dp, src, sp, w, hgt in zip(copies.dst.tolist(), copies.dpitch.tolist(), copies.src.tolist(),
                                        copies.spitch.tolist(), copies.width.tolist(), copies.height.tolist()):
        if dp == sp == w:  # both sides contiguous: one call
            ctypes.memmove(dst, src, w * hgt)
            continue
        for r in range(hgt):
            ctypes.memmove(dst + r * dp, src + r * sp, w)


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing


class CudaRuntime:
    """The few cudart entry points the DMA path and its benchmark use."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self._memcpy2d = lib.cudaMemcpy2DAsync
        self._memcpy2d.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
        self._memcpy2d.restype = ctypes.c_int
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        self._memcpy.restype = ctypes.c_int

    def memcpy_2d_async(self, copies: Copies2D, stream: int) -> None:
        """Enqueue every copy on `stream` (a cudaStream_t as an int, e.g. torch's
        `Stream.cuda_stream`). Pointers are device pointers or registered host memory."""
        f = self._memcpy2d
        for dst, dp, src, sp, w, hgt in zip(copies.dst.tolist(), copies.dpitch.tolist(), copies.src.tolist(),
                                            copies.spitch.tolist(), copies.width.tolist(),
                                            copies.height.tolist()):
            rc = f(dst, dp, src, sp, w, hgt, _CUDA_MEMCPY_DEFAULT, stream)
            if rc != 0:
                raise HiCacheError(f"cudaMemcpy2DAsync failed with CUDA error {rc}")

    def memcpy_async(self, dst: list[int], src: list[int], nbytes: list[int], stream: int) -> None:
        """One cudaMemcpyAsync per chunk (the per-page baseline of the benchmark)."""
        f = self._memcpy
        for d, s, n in zip(dst, src, nbytes):
            rc = f(d, s, n, _CUDA_MEMCPY_DEFAULT, stream)
            if rc != 0:
                raise HiCacheError(f"cudaMemcpyAsync failed with CUDA error {rc}")


@functools.cache
def cuda_runtime() -> CudaRuntime:
    """cudart as loaded by torch in this process (CUDA must be initialized first).
    Raises DmaUnavailable where none is mapped (CPU-only torch, static cudart)."""
    path = _loaded_cudart()
    if path is None:
        raise DmaUnavailable("no libcudart is loaded in this process (is CUDA initialized?)")
    try:
        return CudaRuntime(ctypes.CDLL(path))
    except (OSError, AttributeError) as e:
        raise DmaUnavailable(f"cannot use cudart from {path}: {e}") from e


_CUDART = re.compile(r"\s(/\S*/libcudart\.so[.\d]*)$")


def _loaded_cudart() -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                m = _CUDART.search(line.rstrip("\n"))
                if m:
                    return m.group(1)
    except OSError:
        return None
    return None
