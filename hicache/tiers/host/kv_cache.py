"""The host tier (L2) as engines see it: `HostKVCache`, the arena viewed as KV
pages, with copies to and from a device pool. The arena and its slot allocator
live in `hicache.tiers.host.arena` (torch-free, for the daemon) and are re-exported.

The daemon creates the arena (`HostArena.create`, one memfd per slab) and
sends each engine the fds of the slabs holding its namespace's pages; the
engine maps them into its reservation of the arena (`HostArena.reserve`,
`map_slab`) and moves bytes with `HostKVCache`. Page slot `i` is the
`page_bytes` at byte offset `i * page_bytes`, page-first inside (see
`hicache.layout`).

Copy backends, chosen once per `HostKVCache`:
- "memcpy": CPU pools; one copy per contiguous chunk, each batch of chunks one
  call into a small C loop (kernels/copy.py, native_copy.py).
- "triton": CUDA pools when Triton imports (or CPU under TRITON_INTERPRET).
- "torch": the twin, any device; the reference the others are tested against.

Beside the backend, `dma_min_run_pages` sends runs of at least that many
consecutive page pairs through strided DMA copies instead (`kernels/dma.py`):
on CUDA the copy engine, leaving the SMs to compute. Off by default until a
GPU measurement (`hicache bench transfer --device cuda`) sets the crossover.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from hicache.errors import LayoutError
from hicache.kernels import copy as kcopy
from hicache.kernels import copy_triton, dma
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.arena import HostArena, HostCacheError
from hicache.tiers.host.slots import HostSlotAllocator

__all__ = ["HostArena", "HostCacheError", "HostKVCache", "HostSlotAllocator", "PagePlan"]

log = logging.getLogger(__name__)

BACKENDS = ("memcpy", "torch", "triton")




# ---------------------------------------------------------------------------
# HostKVCache
# ---------------------------------------------------------------------------

@dataclass(slots=True)
class PagePlan:
    """Validated page pairs for one pool, in the forms every backend needs: the
    pages the backend copies, and the long runs (if any) that go by DMA."""

    pool: DevicePool
    host_np: np.ndarray  # int64, CPU
    device_np: np.ndarray  # int64, CPU
    host_t: torch.Tensor  # int64 on CPU (twin) or on the pool's device (triton)
    device_t: torch.Tensor  # int64 on the pool's device
    runs: dma.Runs | None = None

    def __len__(self) -> int:
        return len(self.host_np) + (self.runs.pages if self.runs is not None else 0)


@dataclass(slots=True)
class _PoolViews:
    """Per-pool views and tables, built once per pool."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_ptrs: np.ndarray
    v_ptrs: np.ndarray | None
    k_table: torch.Tensor | None = None  # triton pointer tables, on the pool's device
    v_table: torch.Tensor | None = None


class HostKVCache:
    """The arena viewed as `arena.nbytes // layout.page_bytes` KV page slots.

    `device` is the device of the pools this cache serves; it picks the copy
    backend once ("memcpy" on CPU, "triton" on CUDA when Triton imports, the
    "torch" twin otherwise). Left as None, the first pool passed in decides
    (so `HostKVCache(layout, arena)` serves a CUDA engine as well); `backend`
    forces one. `copy_threads` (memcpy only) splits large copies over that many
    threads; default: torch's intra-op count, the parallelism a torch `copy_` of
    the same bytes would use.
    """

    def __init__(self, layout: KVLayout, arena: HostArena, *, device: str | torch.device | None = None,
                 backend: str | None = None, copy_threads: int | None = None,
                 dma_min_run_pages: int | None = None) -> None:
        self.layout = layout
        self.arena = arena
        self.page_bytes = layout.page_bytes
        self.num_slots = arena.nbytes // layout.page_bytes
        if self.num_slots < 1:
            raise LayoutError(f"a host arena of {arena.nbytes} bytes holds no page of {layout.page_bytes} bytes")
        if backend is not None and backend not in BACKENDS:
            raise LayoutError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.dma_min_run_pages = check_dma_min_run_pages(dma_min_run_pages)
        self.geom = kcopy.PageGeometry.from_layout(layout)
        self._pages_np = arena.array[: self.num_slots * self.page_bytes].reshape(self.num_slots, self.page_bytes)
        self._host = kcopy.host_pages_view(torch.from_numpy(arena.array), self.geom, self.num_slots)
        self._base = arena.address
        self._copier = kcopy.ChunkCopier(copy_threads or torch.get_num_threads())
        self._views: weakref.WeakKeyDictionary[DevicePool, _PoolViews] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._forced_backend = backend
        self.device: torch.device | None = None
        self.backend: str | None = None
        if device is not None:
            self._bind(torch.device(device))

    @property
    def is_native(self) -> bool:
        """Whether the memcpy backend copies through the native batch copy (see
        kernels/native_copy.py) rather than one ctypes memmove per chunk."""
        return self._copier.is_native

    def _bind(self, device: torch.device) -> None:
        """Fix the device type and backend (once)."""
        backend = self._forced_backend or self._pick_backend(device)
        if backend == "memcpy" and device.type != "cpu":
            raise LayoutError("the memcpy backend serves CPU pools only")
        if backend == "triton" and not copy_triton.triton_usable(device):
            raise LayoutError(f"the triton backend cannot run for {device} here")
        if device.type == "cuda":
            self.arena.register_cuda()
            if self.dma_min_run_pages is not None:
                try:
                    dma.cuda_runtime()
                except dma.DmaUnavailable as e:
                    log.warning("DMA copies disabled, the %s backend copies every page: %s", backend, e)
                    self.dma_min_run_pages = None
        self.device, self.backend = device, backend
        log.debug("host cache: %d slots of %d bytes, %s pools, backend %s",
                  self.num_slots, self.page_bytes, device.type, backend)

    @staticmethod
    def _pick_backend(device: torch.device) -> str:
        if device.type == "cuda":
            return "triton" if copy_triton.triton_usable(device) else "torch"
        return "memcpy"

    # -- validation ------------------------------------------------------------------
    def prepare(self, device_pool: DevicePool, host_indices: object, device_indices: object) -> PagePlan:
        """Validate page pairs once (range, equal lengths, no repeated destination)
        and convert them for the backend; raises HostCacheError and changes nothing."""
        self._check_pool(device_pool)
        h = _as_ids(host_indices, "host_indices")
        d = _as_ids(device_indices, "device_indices")
        if len(h) != len(d):
            raise HostCacheError(f"{len(h)} host pages but {len(d)} device pages")
        if len(h):
            if h.min() < 0 or h.max() >= self.num_slots:
                raise HostCacheError(f"host page ids must be in [0, {self.num_slots}), got "
                                     f"{h[(h < 0) | (h >= self.num_slots)][:8].tolist()}")
            if not self.arena.covers(h, self.page_bytes):  # touching those would fault
                raise HostCacheError("host pages outside the slabs mapped here")
            if d.min() < 1 or d.max() > device_pool.num_pages:
                raise HostCacheError(f"device page ids must be in [1, {device_pool.num_pages}] "
                                     f"(page 0 is padding), got "
                                     f"{d[(d < 1) | (d > device_pool.num_pages)][:8].tolist()}")
            # A repeated destination would make the result depend on copy order.
            if len(np.unique(h)) != len(h) or len(np.unique(d)) != len(d):
                raise HostCacheError("a host or device page id repeats within one transfer")
        runs = None
        if self.dma_min_run_pages is not None and len(h):
            long_runs, rest = dma.split_long_runs(h, d, self.dma_min_run_pages)
            if len(long_runs):
                runs, h, d = long_runs, h[rest], d[rest]
        dev = device_pool.device
        d_t = torch.from_numpy(d)
        h_t = torch.from_numpy(h)
        if dev.type != "cpu":
            d_t = d_t.to(dev, non_blocking=True)
            if self.backend == "triton":
                h_t = h_t.to(dev, non_blocking=True)
        return PagePlan(device_pool, h, d, h_t, d_t, runs)

    def bind(self, pool: DevicePool) -> None:
        """Fix this cache's device and backend for `pool` now rather than at its first copy:
        on CUDA that registers the arena (cudaHostRegister takes time in proportion to the
        arena), which belongs at setup, not on the first request's path."""
        self._check_pool(pool)

    def _check_pool(self, pool: DevicePool) -> None:
        self.arena._check_open()
        if pool.layout != self.layout:
            raise LayoutError("device pool layout differs from the host cache layout")
        if self.device is None:
            with self._lock:
                if self.device is None:
                    self._bind(pool.device)
        assert self.device is not None
        if pool.device.type != self.device.type:
            raise LayoutError(f"this host cache serves {self.device.type} pools, got a {pool.device.type} pool")

    def _pool_views(self, pool: DevicePool) -> _PoolViews:
        with self._lock:
            views = self._views.get(pool)
            if views is None:
                for buf in pool.k_buffers + pool.v_buffers:
                    if not buf.is_contiguous():
                        raise LayoutError("device pool buffers must be contiguous")
                g = self.geom
                k = [kcopy.device_pages_view(b, g, g.k_bytes) for b in pool.k_buffers]
                v = [kcopy.device_pages_view(b, g, g.v_bytes) for b in pool.v_buffers]
                views = _PoolViews(k, v, np.array([b.data_ptr() for b in pool.k_buffers], dtype=np.int64),
                                   np.array([b.data_ptr() for b in pool.v_buffers], dtype=np.int64) if v else None)
                if self.backend == "triton":
                    views.k_table = copy_triton.pointer_table(pool.k_buffers, pool.device)
                    views.v_table = copy_triton.pointer_table(pool.v_buffers, pool.device) if v else None
                self._views[pool] = views
            return views

    # -- copies ------------------------------------------------------------------------
    def load_layer(self, plan: PagePlan, layer_id: int) -> None:
        """One layer of a prepared plan, host -> device (on the current CUDA stream)."""
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.layout.num_layers:
            raise HostCacheError(f"layer_id must be in [0, {self.layout.num_layers}), got {layer_id!r}")
        self.arena._check_open()
        if len(plan) == 0:
            return
        views = self._pool_views(plan.pool)
        dev_v = views.v[layer_id] if views.v else None
        v_ptr = int(views.v_ptrs[layer_id]) if views.v_ptrs is not None else None
        if plan.runs is not None:
            self._run_dma(plan, dma.load_layer_copies(self._base, int(views.k_ptrs[layer_id]), v_ptr, plan.runs,
                                                      layer_id, self.geom))
        if len(plan.host_np) == 0:
            return
        if self.backend == "memcpy":
            # streaming stores are chosen by the whole load's bytes (see kcopy.STREAM_MIN_BYTES)
            self._copier.copy(*kcopy.load_layer_chunks(self._base, int(views.k_ptrs[layer_id]), v_ptr,
                                                       plan.host_np, plan.device_np, layer_id, self.geom),
                              transfer_bytes=len(plan.host_np) * self.page_bytes)
        elif self.backend == "triton":
            copy_triton.load_layer_triton(self._host, views.k[layer_id], dev_v, plan.host_t, plan.device_t,
                                          layer_id, self.geom)
        else:
            kcopy.load_layer_torch(self._host, views.k[layer_id], dev_v, plan.host_t, plan.device_t,
                                   layer_id, self.geom)

    def backup(self, plan: PagePlan) -> None:
        """All layers of a prepared plan, device -> host (on the current CUDA stream)."""
        self.arena._check_open()
        if len(plan) == 0:
            return
        views = self._pool_views(plan.pool)
        if plan.runs is not None:
            self._run_dma(plan, dma.backup_copies(self._base, views.k_ptrs, views.v_ptrs, plan.runs, self.geom))
        if len(plan.host_np) == 0:
            return
        if self.backend == "memcpy":
            self._copier.copy(*kcopy.backup_chunks(self._base, views.k_ptrs, views.v_ptrs,
                                                   plan.host_np, plan.device_np, self.geom))
        elif self.backend == "triton":
            assert views.k_table is not None
            copy_triton.backup_all_layers_triton(self._host, views.k_table, views.v_table,
                                                 plan.host_t, plan.device_t, self.geom)
        else:
            kcopy.backup_all_layers_torch(self._host, views.k, views.v, plan.host_t, plan.device_t, self.geom)

    def _run_dma(self, plan: PagePlan, copies: dma.Copies2D) -> None:
        if plan.pool.device.type == "cuda":
            with torch.cuda.device(plan.pool.device):  # cudart's current device must own the stream
                stream = torch.cuda.current_stream().cuda_stream
                dma.cuda_runtime().memcpy_2d_async(copies, stream)
        else:
            dma.run_on_cpu(copies)

    def load_to_device_per_layer(self, device_pool: DevicePool, host_indices: object,
                                 device_indices: object, layer_id: int) -> None:
        """Copy layer `layer_id` of host page slots into device pages (page ids, one each)."""
        self.load_layer(self.prepare(device_pool, host_indices, device_indices), layer_id)

    def backup_from_device_all_layer(self, device_pool: DevicePool, host_indices: object,
                                     device_indices: object) -> None:
        """Copy every layer of device pages into host page slots (page ids, one each)."""
        self.backup(self.prepare(device_pool, host_indices, device_indices))

    # -- whole pages (disk tier) ---------------------------------------------------------
    def read_page(self, slot: int) -> bytes:
        return self._pages_np[self._check_slot(slot)].tobytes()

    def write_page(self, slot: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        slot = self._check_slot(slot)
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        if src.dtype != np.uint8 or src.size != self.page_bytes:
            raise HostCacheError(f"a page is exactly {self.page_bytes} bytes, got {src.nbytes}")
        self._pages_np[slot] = src

    def page_view(self, slot: int) -> memoryview:
        """The page's bytes in place (zero-copy); valid while the arena is open."""
        return memoryview(self._pages_np[self._check_slot(slot)])

    def _check_slot(self, slot: int) -> int:
        self.arena._check_open()
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise HostCacheError(f"host slot must be in [0, {self.num_slots}), got {slot!r}")
        return int(slot)

    def close(self) -> None:
        """Stop copy helper threads. The arena belongs to the caller."""
        self._copier.close()


def check_dma_min_run_pages(value: object) -> int | None:
    """`dma_min_run_pages` as given (a positive int, or None for off); LayoutError otherwise."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise LayoutError(f"dma_min_run_pages must be a positive int or None, got {value!r}")
    return value


def _as_ids(x: object, name: str) -> np.ndarray:
    """Page ids as a 1-D int64 numpy array (from a tensor, array or sequence)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise HostCacheError(f"{name} must hold integers, got {x.dtype}")
        arr = x.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(x)
        if arr.size and arr.dtype.kind not in "iu":
            raise HostCacheError(f"{name} must hold integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise HostCacheError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return np.ascontiguousarray(arr)
