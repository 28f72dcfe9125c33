"""Page copies between the host arena and a device pool: the torch twins (the
specification every backend must match byte for byte) and the CPU memcpy path.

Host side (page-first, see `hicache.layout`): slot `h` is `page_bytes` at
`h * page_bytes`; inside it layer `l` starts at `l * layer_bytes` with the K
block (`k_bytes`) then, for MHA, the V block (`v_bytes`). Device side: the
pool's per-layer K and V buffers, where page `d` is the contiguous run
`[d * k_bytes, (d + 1) * k_bytes)`. A per-layer load is therefore a list of
contiguous chunks copied into contiguous chunks; an all-layer backup is the
same list over every layer, written into the contiguous host page.

Every function here trusts its indices: `HostKVCache` validates them (range,
lengths, duplicate destinations) before calling in. The memcpy path works on
raw addresses, so that validation is what keeps it inside its buffers.

Why two CPU paths (measured on the 2-core dev VM, 32 layers x 8 heads x 128
fp16, 1 GiB of random pages, `python -m hicache.bench.tiers.transfer_bench`). The
twin moves rows through `index_select` + `index_copy_` on wide (int64) views:
correct on any device, but two passes over the bytes (gather into a
temporary, scatter out of it), ~0.45-0.55x a contiguous `copy_`; blocking it
into cache-sized batches did not help. The memcpy path is a single pass: each
batch of chunks is one call into a small C loop (`native_copy`, GIL released),
with streaming stores for copies beyond the last-level cache: ~1x a contiguous
`copy_` at 32 KiB chunks (page 16), ~1.2x at 128 KiB (page 64). Before it, one
ctypes `memmove` per chunk (still the fallback without a C compiler) paid
~1.4 us per call and an ordinary-store read of every destination line:
0.6-0.85x at 32 KiB chunks. Per-chunk torch `copy_` (or `_foreach_copy_`) costs
microseconds of dispatch per chunk; numpy take/put on void rows ran at ~2 GB/s;
process_vm_readv and preadv/pwritev on the memfd were slower than memmove.
Page-first host pages make every per-layer chunk a separate run (layer `l` of
page `h+1` is a whole page away from that of page `h`), so coalescing merges
chunks only where both sides really continue (one-layer MLA, whole pages).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hicache.kernels import native_copy
from hicache.layout import KVLayout

# Widest integer view first: scatter through byte views runs ~7x slower.
_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

# Below this many bytes per call a second thread costs more than it saves.
MIN_SPLIT_BYTES = 4 << 20
# Work unit handed to copy threads.
BATCH_BYTES = 1 << 20
# Without the native library, threads only pay off for chunks at least this large
# on average: every ctypes memmove re-takes the GIL, and with two threads and
# 32 KiB chunks they queue on it (measured: 2 threads = 1 thread at 32 KiB).
MIN_SPLIT_CHUNK_BYTES = 64 << 10


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """Size of cpu0's largest cache (sysfs), or `default` where that is not readable."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if (digits := text.rstrip("KMG")).isdigit():
            sizes.append(int(digits) * mult)
    return max(sizes, default=default)


# Copies moving at least this much use streaming stores (see native_copy), glibc's
# rule for one memcpy (3/4 of the last-level cache) applied to the whole transfer:
# smaller copies stay in cache for the attention that reads the layer next. A
# per-layer load is judged by the bytes of all its layers, not of one call: once
# they exceed the cache, a layer is evicted by the later ones before attention
# reads it, and ordinary stores only add a read of every destination line.
# Measured (2-core VM, 16-token pages, 32 layers, transfer_bench): layers of
# 2-8 MiB (64-256 MiB loads) with ordinary stores 0.53-0.90 of a contiguous
# copy_, with streaming stores 0.9-1.4.
STREAM_MIN_BYTES = _last_level_cache_bytes() * 3 // 4


def use_streaming(call_bytes: int, transfer_bytes: int | None = None) -> bool:
    """Whether a copy call of `call_bytes`, part of a transfer of `transfer_bytes`
    (default: the call alone), takes streaming stores."""
    return max(call_bytes, transfer_bytes or 0) >= STREAM_MIN_BYTES


def wide_dtype(*sizes: int) -> tuple[torch.dtype, int]:
    """The widest integer dtype whose itemsize divides every byte size given."""
    for width, dtype in _WIDE_DTYPES:
        if all(s % width == 0 for s in sizes):
            return dtype, width
    raise AssertionError("unreachable: uint8 divides everything")


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """Byte geometry of one layout, plus the element width every backend copies in."""

    num_layers: int
    page_bytes: int
    layer_bytes: int
    k_bytes: int
    v_bytes: int  # 0 for MLA
    width: int  # bytes per copied element

    @classmethod
    def from_layout(cls, layout: KVLayout) -> PageGeometry:
        sizes = (layout.k_page_bytes, layout.v_page_bytes) if layout.has_v else (layout.k_page_bytes,)
        _, width = wide_dtype(*sizes)
        return cls(layout.num_layers, layout.page_bytes, layout.layer_page_bytes,
                   layout.k_page_bytes, layout.v_page_bytes, width)

    @property
    def dtype(self) -> torch.dtype:
        return wide_dtype(self.width)[0]

    @property
    def has_v(self) -> bool:
        return self.v_bytes > 0

    # Element counts and offsets in units of `width` bytes.
    @property
    def page_elems(self) -> int:
        return self.page_bytes // self.width

    @property
    def k_elems(self) -> int:
        return self.k_bytes // self.width

    @property
    def v_elems(self) -> int:
        return self.v_bytes // self.width

    def k_offset(self, layer: int) -> int:
        return layer * self.layer_bytes // self.width

    def v_offset(self, layer: int) -> int:
        return (layer * self.layer_bytes + self.k_bytes) // self.width


def host_pages_view(arena_u8: torch.Tensor, geom: PageGeometry, num_slots: int) -> torch.Tensor:
    """The arena's first `num_slots` pages as `[num_slots, page_elems]` (a view, no copy)."""
    return arena_u8[: num_slots * geom.page_bytes].view(geom.dtype).view(num_slots, geom.page_elems)


def device_pages_view(buf: torch.Tensor, geom: PageGeometry, chunk_bytes: int) -> torch.Tensor:
    """A pool buffer `[rows, heads, dim]` as `[pages, chunk elems]` in the wide dtype (a view)."""
    return buf.view(-1).view(torch.uint8).view(geom.dtype).view(-1, chunk_bytes // geom.width)


# ---------------------------------------------------------------------------
# Torch twins: the specification. Work for CPU and CUDA pools alike.
# ---------------------------------------------------------------------------

def load_layer_torch(host: torch.Tensor, dev_k: torch.Tensor, dev_v: torch.Tensor | None,
                     host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int,
                     geom: PageGeometry) -> None:
    """Host slots `host_pages` -> device pages `device_pages`, one layer.

    `host` is `host_pages_view(...)` (CPU); `dev_k`/`dev_v` are `device_pages_view`s
    on the pool's device; `host_pages` is a CPU int64 tensor, `device_pages` an int64
    tensor on the pool's device.
    """
    parts = [(dev_k, geom.k_offset(layer), geom.k_elems)]
    if dev_v is not None:
        parts.append((dev_v, geom.v_offset(layer), geom.v_elems))
    for dst, off, n in parts:
        rows = host[:, off:off + n].index_select(0, host_pages)
        dst.index_copy_(0, device_pages, rows.to(dst.device, non_blocking=True))


def backup_all_layers_torch(host: torch.Tensor, dev_k: list[torch.Tensor], dev_v: list[torch.Tensor],
                            host_pages: torch.Tensor, device_pages: torch.Tensor,
                            geom: PageGeometry) -> None:
    """Device pages `device_pages` (every layer) -> host slots `host_pages`.

    `dev_k[l]`/`dev_v[l]` are `device_pages_view`s; `dev_v` is empty for MLA.
    """
    for layer in range(geom.num_layers):
        parts = [(dev_k[layer], geom.k_offset(layer), geom.k_elems)]
        if dev_v:
            parts.append((dev_v[layer], geom.v_offset(layer), geom.v_elems))
        for src, off, n in parts:
            rows = src.index_select(0, device_pages).to(host.device)
            host[:, off:off + n].index_copy_(0, host_pages, rows)


# ---------------------------------------------------------------------------
# CPU memcpy path.
# ---------------------------------------------------------------------------

def load_layer_chunks(host_base: int, k_ptr: int, v_ptr: int | None, host_pages: np.ndarray,
                      device_pages: np.ndarray, layer: int,
                      geom: PageGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, nbytes) of every chunk of a per-layer load, page by page, K before V,
    so the host side is read in address order within each page."""
    h = host_base + host_pages * geom.page_bytes + layer * geom.layer_bytes
    src = [h]
    dst = [k_ptr + device_pages * geom.k_bytes]
    sizes = [geom.k_bytes]
    if v_ptr is not None:
        src.append(h + geom.k_bytes)
        dst.append(v_ptr + device_pages * geom.v_bytes)
        sizes.append(geom.v_bytes)
    return _interleave(src, dst, sizes, len(host_pages))


def backup_chunks(host_base: int, k_ptrs: np.ndarray, v_ptrs: np.ndarray | None, host_pages: np.ndarray,
                  device_pages: np.ndarray, geom: PageGeometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, nbytes) of every chunk of an all-layer backup, ordered so each host
    page is written front to back."""
    layer_off = np.arange(geom.num_layers, dtype=np.int64) * geom.layer_bytes
    h = (host_base + host_pages * geom.page_bytes)[:, None] + layer_off[None, :]  # [n, L]
    src = [k_ptrs[None, :] + (device_pages * geom.k_bytes)[:, None]]
    dst = [h]
    sizes = [geom.k_bytes]
    if v_ptrs is not None:
        src.append(v_ptrs[None, :] + (device_pages * geom.v_bytes)[:, None])
        dst.append(h + geom.k_bytes)
        sizes.append(geom.v_bytes)
    return _interleave(src, dst, sizes, len(host_pages) * geom.num_layers)


def _interleave(src: list[np.ndarray], dst: list[np.ndarray], sizes: list[int],
                n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = len(sizes)
    s = np.stack([a.reshape(-1) for a in src], axis=1).reshape(-1)
    d = np.stack([a.reshape(-1) for a in dst], axis=1).reshape(-1)
    nb = np.tile(np.asarray(sizes, dtype=np.int64), n)
    assert len(s) == len(d) == len(nb) == n * k
    return s, d, nb


def coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each chunk into the previous one where both sides continue it exactly
    (runs of consecutive host and device pages), so a run is one memmove."""
    if len(src) < 2:
        return src, dst, nbytes
    cont = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    if not cont.any():
        return src, dst, nbytes
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(nbytes, starts)


def strided_runs(view: torch.Tensor) -> tuple[np.ndarray, int]:
    """`view`'s bytes in C order as equal contiguous runs: (byte offsets of the runs
    from ``view.data_ptr()``, bytes per run). One run for a contiguous view; e.g.
    one per layer and K/V for a page of a layer-first pool."""
    item = view.element_size()
    shape, strides = list(view.shape), list(view.stride())
    run, d = 1, len(shape)
    while d > 0 and (shape[d - 1] == 1 or strides[d - 1] == run):  # merge the contiguous tail
        run *= shape[d - 1]
        d -= 1
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(shape[:d], strides[:d]):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
    return offsets * item, run * item


def page_run_chunks(page_ptrs: np.ndarray, run_offsets: np.ndarray, run_bytes: int, flat_ptrs: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(strided, flat, nbytes) chunk tables pairing each strided page (`page_ptrs`, its
    runs at `run_offsets`) with the flat page at the same position of `flat_ptrs`."""
    strided = (page_ptrs[:, None] + run_offsets[None, :]).reshape(-1)
    flat = (flat_ptrs[:, None] + np.arange(len(run_offsets), dtype=np.int64)[None, :] * run_bytes).reshape(-1)
    return strided, flat, np.full(len(strided), run_bytes, dtype=np.int64)


_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL for the copy


def memmove_all(src: list[int], dst: list[int], nbytes: list[int]) -> None:
    """One memmove per (src, dst, nbytes) chunk, in order."""
    for s, d, n in zip(src, dst, nbytes):
        _memmove(d, s, n)


class ChunkCopier:
    """Copies many (src, dst, nbytes) chunks, coalesced, spread over threads.

    Each batch of chunks is one call into `native_copy` (the GIL released for
    the whole batch), streaming stores when the transfer moves at least
    `STREAM_MIN_BYTES`; without the native library, one ctypes memmove per chunk.
    The calling thread copies too, so `num_threads=1` starts no thread. With
    more, threads pull ~`BATCH_BYTES` batches from a shared counter: a thread the
    OS deschedules (other work on the cores) holds up one batch, not a fixed
    share. Thread-safe: concurrent `copy` calls share the helper pool.
    """

    def __init__(self, num_threads: int = 1, min_split_bytes: int = MIN_SPLIT_BYTES,
                 min_chunk_bytes: int = MIN_SPLIT_CHUNK_BYTES, native: bool = True) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self.min_split_bytes = min_split_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self._native: native_copy.NativeChunkCopy | None = None
        self._native_tried = not native  # loaded on first use: CUDA engines never need it
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def is_native(self) -> bool:
        if not self._native_tried:  # benign race: chunk_copy() is locked and cached
            self._native = native_copy.chunk_copy()
            self._native_tried = True
        return self._native is not None

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *,
             transfer_bytes: int | None = None, streaming: bool | None = None) -> None:
        """Copy every chunk. `transfer_bytes`: the size of the whole transfer this call
        is part of (all layers of a per-layer load), which picks streaming stores
        (`STREAM_MIN_BYTES`); default: this call's bytes. `streaming` True / False
        decides instead (True: nothing reads the destination soon, e.g. a save into
        host pages, whatever its size)."""
        src, dst, nbytes = coalesce(src, dst, nbytes)
        total = int(nbytes.sum())
        if streaming is None:
            streaming = use_streaming(total, transfer_bytes)
        workers = min(self.num_threads, len(src), max(1, total // max(1, self.min_split_bytes)))
        if not self.is_native and total < self.min_chunk_bytes * len(src):
            workers = 1  # per-chunk ctypes calls: small chunks queue on the GIL
        run = self._batch_runner(src, dst, nbytes, stream=streaming)
        if workers <= 1:
            run(0, len(src))
            return
        batches = max(workers, min(len(src), total // BATCH_BYTES))
        cuts = np.searchsorted(np.cumsum(nbytes), total * np.arange(1, batches) / batches, side="right")
        job = _SharedJob(np.unique(np.concatenate(([0], cuts, [len(src)]))).tolist(), run)
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="hicache-copy")
            for _ in range(workers - 1):
                self._pool.submit(job.work)
        job.work()
        job.wait()

    def _batch_runner(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                      stream: bool) -> Callable[[int, int], None]:
        """`run(a, b)` copies chunks `a:b`."""
        if self._native is not None:
            copy_at = self._native.copy_at
            tables = [np.ascontiguousarray(x, dtype=np.int64) for x in (src, dst, nbytes)]
            sp, dp, npp = (t.ctypes.data for t in tables)
            flag = int(stream)

            def run(a: int, b: int, _keep: list[np.ndarray] = tables) -> None:
                # Addresses, not slices: the GIL is held only for the call itself.
                copy_at(sp + 8 * a, dp + 8 * a, npp + 8 * a, b - a, flag)
            return run
        s, d, n = src.tolist(), dst.tolist(), nbytes.tolist()
        return lambda a, b: memmove_all(s[a:b], d[a:b], n[a:b])

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _SharedJob:
    """Batches `bounds[i]:bounds[i + 1]` pulled by whichever thread comes first.

    The caller waits for the batches, not for the helpers: a helper whose core
    wakes late (a VM wakes a halted vCPU in milliseconds) finds the work gone
    and costs nothing, where waiting on its future would add that wake-up to
    every call.
    """

    __slots__ = ("_bounds", "_run", "_next", "_left", "_lock", "_done", "_error")

    def __init__(self, bounds: list[int], run: Callable[[int, int], None]) -> None:
        self._bounds = bounds
        self._run = run
        self._next = itertools.count()  # next() on it is atomic under the GIL
        self._left = len(bounds) - 1
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def work(self) -> None:
        while (i := next(self._next)) < len(self._bounds) - 1:
            try:
                self._run(self._bounds[i], self._bounds[i + 1])
            except BaseException as e:  # noqa: BLE001 - raised by wait() in the caller
                self._error = e
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error
