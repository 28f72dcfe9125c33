"""Copies between an engine's own per-layer KV block tensors and host arena pages.

Engines with their own KV cache (vLLM) allocate one tensor per attention layer
in the layout of their attention backend, e.g. vLLM's CPU backend
`[num_blocks, kv_heads, block_size, 2 * head_size]` (per block and head, K then
V) or its CUDA flash-attention layout `[2, num_blocks, block_size, kv_heads,
head_size]`. Whatever the layout, one dimension indexes blocks; moving it first
gives each block's bytes for that layer, which is what a host page keeps for
the layer: page = [layer 0 block bytes][layer 1 block bytes]...

The bytes of a block are kept as the backend arranges them, not converted:
a save followed by a load is a bit-exact round trip whatever the backend means
by them, and no conversion costs copy bandwidth. The price is that pages are
only shared between engines whose backends arrange blocks alike, so the
connector puts the arrangement into the namespace (see vllm/layout.py).

Two ways to move the bytes, which write the same page bytes:
- CPU tensors (`native`): a block of a layer is a few contiguous runs of
  memory (one for vLLM's CPU layout, K and V for a block-dim-1 layout), so a
  save is one call into the native chunk copier (`hicache.kernels.copy`) with
  every (block, layer, run) chunk and a per-layer load one call with that
  layer's chunks: one pass over the bytes, the GIL released, no torch op and
  so no OpenMP team of the copying thread competing with the engine's
  threads. Saves use streaming stores at any size (the engine does not read the
  pages it saved: ordinary stores would first read every destination line into
  the cache and evict the engine's own data); a load streams by the size of all
  its layers (`hicache.kernels.copy.use_streaming`), since attention reads the
  first layers soon. Measured (`hicache bench blockcopy`): see the README.
- CUDA tensors (`triton`): one launch of `copy_triton.copy_block_runs` per
  layer loaded or per save, on the caller's current stream, straight between
  the KV tensors and the arena (registered with CUDA, so the kernel addresses
  its pages; no staging copy). The same runs as the native path, cut into
  pieces of at most a few KiB; under TRITON_INTERPRET it runs on CPU tensors,
  which is how the tests check it without a GPU.
- Otherwise (`torch`: no Triton, no C compiler, runs too short to pay):
  `index_select` + `index_copy_` per layer, the specification the others are
  tested against. It makes two passes (gather into a temporary, scatter out of
  it; on CUDA the temporary is on the host) and was the connector's copy path
  before the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hicache.errors import LayoutError
from hicache.kernels import copy_triton
from hicache.kernels.copy import ChunkCopier, wide_dtype
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena

CopyMethod = Literal["auto", "native", "triton", "torch"]

# Shorter contiguous runs per block go through torch: the chunk tables would
# outweigh the bytes (a backend whose innermost dim is not contiguous in memory).
MIN_RUN_BYTES = 256
# The kernel copies runs in pieces of at most this many bytes (a program's rows).
MAX_PIECE_BYTES = 8192


def block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks (exactly one must
    have `num_blocks` entries among the first two; backends put it there)."""
    dims = [d for d in range(min(2, len(shape))) if shape[d] == num_blocks]
    if len(dims) != 1:
        raise LayoutError(f"cannot tell the block dimension of a KV tensor shaped {tuple(shape)} "
                          f"with {num_blocks} blocks")
    return dims[0]


def arrangement(t: torch.Tensor, num_blocks: int) -> str:
    """A short name for how a backend arranges a layer's blocks: the tensor's shape with
    the block count as 'B' (e.g. 'B,2,32,64'), its block dimension and dtype."""
    bd = block_dim(t.shape, num_blocks)
    dims = ["B" if d == bd else str(n) for d, n in enumerate(t.shape)]
    return f"{','.join(dims)}:{str(t.dtype).removeprefix('torch.')}"


@dataclass(frozen=True, slots=True)
class BlockRuns:
    """Where one layer's blocks lie in memory: block `b` is the runs at
    `address + b * block_stride + offsets[j]`, `run_bytes` each, in the order
    (row-major over the block's logical shape) a host page keeps them."""

    address: int
    block_stride: int
    offsets: np.ndarray  # int64 byte offsets, one per run
    run_bytes: int

    @classmethod
    def of(cls, v: torch.Tensor, min_run_bytes: int = MIN_RUN_BYTES) -> BlockRuns | None:
        """The runs of `v` (block dim first), or None where a block is not made of runs
        of at least `min_run_bytes` (or its memory overlaps itself)."""
        dims = [(n, s) for n, s in zip(v.shape[1:], v.stride()[1:]) if n != 1]
        inner = 1  # elements per run: the longest row-major contiguous suffix of the dims
        while dims and dims[-1][1] == inner:
            inner *= dims.pop()[0]
        if any(s == 0 for _, s in dims) or (v.shape[0] > 1 and v.stride(0) == 0):
            return None  # expanded: blocks or runs share memory
        es = v.element_size()
        offsets = np.zeros(1, dtype=np.int64)
        for n, s in dims:  # outer dims enumerate the runs, row-major
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s * es).reshape(-1)
        if inner * es < min_run_bytes:
            return None
        return cls(v.data_ptr(), v.stride(0) * es, offsets, inner * es)


@dataclass(frozen=True, slots=True)
class _AllLayerRuns:
    """Every layer's runs at once, where layers differ only in their address (one
    allocation per layer, as backends do): a save's chunk tables in one broadcast."""

    addresses: np.ndarray  # [layers] int64
    block_stride: int
    offsets: np.ndarray  # [runs] byte offsets in a block
    page_offsets: np.ndarray  # [layers, runs] byte offsets in a page
    run_bytes: int

    @classmethod
    def of(cls, runs: list[BlockRuns], layer_page_bytes: int) -> _AllLayerRuns | None:
        r0 = runs[0]
        if any(r.block_stride != r0.block_stride or r.run_bytes != r0.run_bytes
               or not np.array_equal(r.offsets, r0.offsets) for r in runs):
            return None
        layers = np.arange(len(runs), dtype=np.int64)
        page_offsets = layers[:, None] * layer_page_bytes + np.arange(len(r0.offsets), dtype=np.int64) * r0.run_bytes
        return cls(np.array([r.address for r in runs], dtype=np.int64), r0.block_stride, r0.offsets,
                   page_offsets, r0.run_bytes)


class BlockCopier:
    """Moves whole blocks, all layers or one layer at a time, between `caches` (one tensor
    per layer, in layer order) and the pages of `arena` laid out for `layout`.

    `method`: "native" (CPU tensors only; LayoutError otherwise), "triton" (CUDA
    tensors, or CPU ones under TRITON_INTERPRET; LayoutError where it cannot run),
    "torch", or "auto" (native on CPU, triton on CUDA, where they can run);
    afterwards `method` says which one runs. Every copy runs on the calling thread
    (on CUDA: is queued on its current stream) and none starts a thread."""

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int, layout: KVLayout,
                 arena: HostArena, method: CopyMethod = "auto") -> None:
        if len(caches) != layout.num_layers:
            raise LayoutError(f"{len(caches)} KV tensors for a layout of {layout.num_layers} layers")
        if method not in ("auto", "native", "triton", "torch"):
            raise LayoutError(f"copy method must be auto, native, triton or torch, not {method!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.blocks: list[torch.Tensor] = []  # per layer: [num_blocks, ...] views (block dim first)
        for t in caches:
            v = t.movedim(block_dim(t.shape, num_blocks), 0)
            nbytes = v[0].numel() * v.element_size()
            if nbytes != layout.layer_page_bytes:
                raise LayoutError(f"a KV block holds {nbytes} bytes per layer; the layout's page needs "
                                  f"{layout.layer_page_bytes}")
            self.blocks.append(v)
        self.device = caches[0].device
        self._page_bytes, self._lpb = layout.page_bytes, layout.layer_page_bytes  # (properties: computed per use)
        self.runs: list[BlockRuns] = []
        self._run_dst: list[np.ndarray] = []
        self._all_layers: _AllLayerRuns | None = None
        self._chunks: ChunkCopier | None = None
        self._kernel: _KernelTables | None = None
        if method == "triton" or (method == "auto" and self.device.type == "cuda"):
            self._kernel = _KernelTables.build(self.blocks, layout, self.device, required=method == "triton")
        elif method != "torch":
            self._setup_native(method == "native")
        self.method: CopyMethod = ("native" if self._chunks is not None
                                   else "triton" if self._kernel is not None else "torch")
        self.rebind(arena)

    def _setup_native(self, required: bool) -> None:
        runs = [BlockRuns.of(v) for v in self.blocks] if self.device.type == "cpu" else []
        why = ("KV tensors are not on the CPU" if self.device.type != "cpu"
               else f"a block is not made of runs of >= {MIN_RUN_BYTES} bytes" if None in runs else None)
        chunks = ChunkCopier(1)
        if why is None and not chunks.is_native:
            why = "the native chunk copier cannot be built here"
        if why is None:
            self.runs, self._chunks = [r for r in runs if r is not None], chunks
            # Per layer, where each run goes in a page's layer (byte offsets), so a copy's
            # chunk tables are a few array ops: per-call Python was 0.4 ms, as long as the
            # copy of 2.5 MiB it served.
            self._run_dst = [np.arange(len(r.offsets), dtype=np.int64) * r.run_bytes for r in self.runs]
            self._all_layers = _AllLayerRuns.of(self.runs, self._lpb)
        elif required:
            raise LayoutError(f"native block copies cannot run: {why}")

    def rebind(self, arena: HostArena) -> None:
        """Copy to and from this arena from now on (a restarted daemon has a new one)."""
        lpb = self.layout.layer_page_bytes
        num_slots = arena.nbytes // self.layout.page_bytes
        flat = torch.from_numpy(arena.array[: num_slots * self.layout.page_bytes])
        self.host = flat.view(num_slots, self.layout.num_layers, lpb)  # [slot, layer, bytes]
        wide, _ = wide_dtype(lpb)
        self._host_wide = self.host.view(wide)  # index_copy_ of byte rows is several times slower
        if self._kernel is not None:
            self._host_kernel = flat.view(self._kernel.geom.dtype).view(num_slots, self._kernel.geom.page_elems)
        if self.device.type == "cuda":
            arena.register_cuda()  # kernels and DMA address its pages directly (slabs mapped later too)
        self.arena = arena
        self._host_ptr = self.host.data_ptr()

    def _ids(self, block_ids: Sequence[int], host_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        b = np.asarray(block_ids, dtype=np.int64)
        h = np.asarray(host_pages, dtype=np.int64)
        if b.shape != h.shape or b.ndim != 1:
            raise LayoutError(f"{len(block_ids)} blocks for {len(host_pages)} host pages")
        if len(b) and (int(b.min()) < 0 or int(b.max()) >= self.num_blocks):
            raise LayoutError(f"block ids must be in [0, {self.num_blocks})")
        if len(h) and (int(h.min()) < 0 or int(h.max()) >= self.host.shape[0]):
            raise LayoutError(f"host pages must be in [0, {self.host.shape[0]})")
        if not self.arena.covers(h, self._page_bytes):
            raise LayoutError("host pages lie outside the slabs mapped here")
        return b, h

    def _page_address(self, h: np.ndarray, layer: int) -> np.ndarray:
        return self._host_ptr + h * self._page_bytes + layer * self._lpb

    def save(self, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        """Every layer of the blocks into the host pages."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        if self._kernel is not None:
            self._run_kernel(b, h, 0, len(self.blocks), to_host=True)
            return
        if self._chunks is None:
            self._save_torch(b, h)
            return
        if (a := self._all_layers) is not None:  # layer after layer (faster here than page after page)
            src = a.addresses[:, None, None] + (b * a.block_stride)[None, :, None] + a.offsets
            dst = (self._host_ptr + h * self._page_bytes)[None, :, None] + a.page_offsets[:, None, :]
            self._chunks.copy(src.reshape(-1), dst.reshape(-1), np.full(src.size, a.run_bytes, dtype=np.int64),
                              streaming=True)
            return
        src, dst, size = [], [], []
        for layer, (r, run_dst) in enumerate(zip(self.runs, self._run_dst)):
            src.append((r.address + b[:, None] * r.block_stride + r.offsets).reshape(-1))
            dst.append((self._page_address(h, layer)[:, None] + run_dst).reshape(-1))
            size.append(np.full(src[-1].size, r.run_bytes, dtype=np.int64))
        self._chunks.copy(np.concatenate(src), np.concatenate(dst), np.concatenate(size), streaming=True)

    def save_layer(self, layer: int, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        """One layer of the blocks into the host pages (hybrid models: each layer's group
        has its own block ids for a page)."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        if self._kernel is not None:
            self._run_kernel(b, h, layer, 1, to_host=True)
            return
        if self._chunks is None:
            self._save_layer_torch(layer, torch.from_numpy(b).to(self.device), torch.from_numpy(h))
            return
        r = self.runs[layer]
        src = r.address + b[:, None] * r.block_stride + r.offsets
        dst = self._page_address(h, layer)[:, None] + self._run_dst[layer]
        self._chunks.copy(src.reshape(-1), dst.reshape(-1), np.full(src.size, r.run_bytes, dtype=np.int64),
                          streaming=True)

    def load_layer(self, layer: int, block_ids: Sequence[int], host_pages: Sequence[int], *,
                   transfer_bytes: int | None = None) -> None:
        """One layer of the host pages into the blocks; `transfer_bytes`: the bytes of every
        layer of this load, which pick streaming stores (default: this layer's)."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        if self._kernel is not None:
            self._run_kernel(b, h, layer, 1, to_host=False)
            return
        if self._chunks is None:
            self._load_layer_torch(layer, b, h)
            return
        r = self.runs[layer]
        src = self._page_address(h, layer)[:, None] + self._run_dst[layer]
        dst = r.address + b[:, None] * r.block_stride + r.offsets
        self._chunks.copy(src.reshape(-1), dst.reshape(-1), np.full(src.size, r.run_bytes, dtype=np.int64),
                          transfer_bytes=transfer_bytes)

    # -- the kernel path ------------------------------------------------------------------
    def _run_kernel(self, b: np.ndarray, h: np.ndarray, layer0: int, num_layers: int, *, to_host: bool) -> None:
        k = self._kernel
        assert k is not None
        # Made on the current stream, so the allocator keeps them for that stream's kernels.
        bt = torch.from_numpy(b).to(self.device, non_blocking=True)
        ht = torch.from_numpy(h).to(self.device, non_blocking=True)
        copy_triton.copy_block_runs(self._host_kernel, k.base_ptrs, k.run_offs, bt, ht, layer0, num_layers,
                                    k.geom, to_host=to_host)

    # -- the torch path ------------------------------------------------------------------
    def _save_torch(self, b: np.ndarray, h: np.ndarray) -> None:
        bd = torch.from_numpy(b).to(self.device)
        ht = torch.from_numpy(h)
        for layer in range(len(self.blocks)):
            self._save_layer_torch(layer, bd, ht)

    def _torch_view(self, layer: int) -> torch.Tensor:
        v = self.blocks[layer]
        return v.view(torch.uint8) if v.element_size() == 1 else v  # fp8: index ops of every build take bytes

    def _save_layer_torch(self, layer: int, bd: torch.Tensor, ht: torch.Tensor) -> None:
        src = self._torch_view(layer).index_select(0, bd).reshape(len(bd), -1).view(torch.uint8)
        self._host_wide[:, layer].index_copy_(0, ht, src.view(self._host_wide.dtype).cpu())

    def _load_layer_torch(self, layer: int, b: np.ndarray, h: np.ndarray) -> None:
        v = self._torch_view(layer)
        src = self.host[:, layer].index_select(0, torch.from_numpy(h)).to(self.device, non_blocking=True)
        v[torch.from_numpy(b).to(self.device)] = src.view(v.dtype).reshape(len(b), *v.shape[1:])


@dataclass(frozen=True, slots=True)
class _KernelTables:
    """What `copy_block_runs` reads for these KV tensors: the geometry, the layers'
    addresses and the runs' offsets (int64 tables on the tensors' device)."""

    geom: copy_triton.RunGeometry
    base_ptrs: torch.Tensor
    run_offs: torch.Tensor

    @classmethod
    def build(cls, blocks: list[torch.Tensor], layout: KVLayout, device: torch.device,
              required: bool) -> _KernelTables | None:
        """None (LayoutError if `required`) where the kernel cannot run here or the
        layers' blocks are not laid out alike (one geometry serves every layer)."""
        runs = [BlockRuns.of(v, min_run_bytes=1) for v in blocks]
        why = None
        if not copy_triton.triton_usable(device):
            why = f"triton cannot run for {device} here"
        elif None in runs:
            why = "a block's memory overlaps itself"
        elif any(r.block_stride != runs[0].block_stride or r.run_bytes != runs[0].run_bytes  # type: ignore[union-attr]
                 or not np.array_equal(r.offsets, runs[0].offsets) for r in runs):  # type: ignore[union-attr]
            why = "the layers' KV tensors are laid out differently"
        if why is not None:
            if required:
                raise LayoutError(f"triton block copies cannot run: {why}")
            return None
        r0 = runs[0]
        assert r0 is not None
        piece = _piece_bytes(r0.run_bytes)
        offsets = (r0.offsets[:, None] + np.arange(r0.run_bytes // piece, dtype=np.int64) * piece).reshape(-1)
        addresses = [r.address for r in runs]  # type: ignore[union-attr]
        sizes = [piece, r0.block_stride, layout.page_bytes, *offsets.tolist(), *addresses]
        _, width = wide_dtype(*sizes)
        align = 16 if all(x % 16 == 0 for x in sizes) else width
        geom = copy_triton.RunGeometry(width, piece // width, r0.block_stride // width, len(offsets),
                                       layout.page_bytes // width, layout.layer_page_bytes // width, align)
        return cls(geom, torch.tensor(addresses, dtype=torch.int64, device=device),
                   torch.from_numpy(offsets // width).to(device))


def _piece_bytes(run_bytes: int) -> int:
    """The length runs are cut into: a divisor of the run, at most MAX_PIECE_BYTES, filling
    as much of a power-of-two row as it can (the kernel's rows are powers of two)."""
    if run_bytes <= MAX_PIECE_BYTES:
        return run_bytes
    cands = [d for d in range(1, MAX_PIECE_BYTES + 1) if run_bytes % d == 0]
    return max(cands, key=lambda d: (min(d, 512) * d / copy_triton.triton_next_pow2(d), d))
