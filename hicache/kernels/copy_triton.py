"""Triton kernels for page copies between the host arena and a device pool;
`copy.py` holds their torch twins (the results must be `torch.equal`).

Both kernels copy in the wide integer dtype of `PageGeometry` and read the
page-first host layout with strides:

- `load_layer`: one layer, host slots -> device pages. Grid `(pages, blocks)`;
  program `(i, b)` copies block `b` of page pair `i`, K and (MHA) V.
- `backup_all_layers`: every layer, device pages -> host slots, in one launch.
  Grid `(pages, layers, blocks)`; the per-layer pool buffers are reached through
  a table of their addresses (built once per pool by the caller).
- `copy_block_runs`: an engine's own per-layer block tensors (vLLM) <-> host
  pages, either direction, one layer or several per launch. A block of a layer
  is a list of equal runs at fixed offsets from the block's address (see
  `integrations/block_copy.BlockRuns`): vLLM's CUDA default stores a block
  token-major while its pages keep it head-major, so a block is heads x tokens
  runs of one token-head's K and V. Grid `(pages, layers, tiles)`; a program
  copies `ROWS` runs of one block, each a contiguous row on both sides.

On CUDA the host arena must be registered (`HostArena.register_cuda`) so the
kernels can address it directly (unified addressing); no staging buffer.

Triton is imported on first use, never at module import: this module loads on
machines without Triton, and the kernels see `TRITON_INTERPRET` as it is when
they are first built (the interpreter runs them on CPU tensors, which is how
the tests check them without a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from hicache.kernels.copy import PageGeometry, wide_dtype
from hicache.kernels.triton_env import device_supported

# Elements per program; pages are copied in blocks of this many wide elements.
_BLOCK = 1024


def triton_usable(device: torch.device) -> bool:
    """Whether the kernels can run for a pool on `device`: CUDA, or CPU under the
    interpreter; and Triton imports."""
    if not device_supported(device):
        return False
    try:
        _kernels()
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    # Page-id tensors are re-sliced and `layer` changes with every call: specializing
    # on their alignment or value would compile new variants mid-serving. The sizes
    # stay specializable (fixed per layout): knowing them divisible by 16 is what
    # lets the compiler prove alignment and issue 16-byte loads and stores.
    @triton.jit(do_not_specialize=["host_idx_ptr", "dev_idx_ptr", "layer"])
    def load_layer_kernel(host_ptr, dev_k_ptr, dev_v_ptr, host_idx_ptr, dev_idx_ptr, layer,
                          page_elems, layer_elems, k_elems, v_elems,
                          HAS_V: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.load(host_idx_ptr + i).to(tl.int64)
        d = tl.load(dev_idx_ptr + i).to(tl.int64)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        src = host_ptr + h * page_elems + layer.to(tl.int64) * layer_elems
        mk = offs < k_elems
        x = tl.load(src + offs, mask=mk)
        tl.store(dev_k_ptr + d * k_elems + offs, x, mask=mk)
        if HAS_V:
            mv = offs < v_elems
            y = tl.load(src + k_elems + offs, mask=mv)
            tl.store(dev_v_ptr + d * v_elems + offs, y, mask=mv)

    @triton.jit(do_not_specialize=["host_idx_ptr", "dev_idx_ptr"])
    def backup_kernel(host_ptr, k_ptrs, v_ptrs, host_idx_ptr, dev_idx_ptr,
                      page_elems, layer_elems, k_elems, v_elems,
                      HAS_V: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        layer = tl.program_id(1)
        b = tl.program_id(2)
        h = tl.load(host_idx_ptr + i).to(tl.int64)
        d = tl.load(dev_idx_ptr + i).to(tl.int64)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        elem_ptr = tl.pointer_type(host_ptr.dtype.element_ty)
        dst = host_ptr + h * page_elems + layer.to(tl.int64) * layer_elems
        mk = offs < k_elems
        # Pool buffers start 16-byte aligned (`pointer_table` checks); said here, since
        # an address loaded from the table tells the compiler nothing.
        k_base = tl.multiple_of(tl.load(k_ptrs + layer).to(elem_ptr), 16)
        x = tl.load(k_base + d * k_elems + offs, mask=mk)
        tl.store(dst + offs, x, mask=mk)
        if HAS_V:
            mv = offs < v_elems
            v_base = tl.multiple_of(tl.load(v_ptrs + layer).to(elem_ptr), 16)
            y = tl.load(v_base + d * v_elems + offs, mask=mv)
            tl.store(dst + k_elems + offs, y, mask=mv)

    # One compiled variant per engine geometry (run length, alignment): fixed for a
    # process, and a constant run length turns the per-run index math into shifts.
    @triton.jit(do_not_specialize=["block_idx_ptr", "page_idx_ptr", "layer0"])
    def block_runs_kernel(host_ptr, base_ptrs, run_offs_ptr, block_idx_ptr, page_idx_ptr, layer0,
                          block_stride, page_elems, layer_elems, num_runs,
                          RUN_ELEMS: tl.constexpr, RUN_BLOCK: tl.constexpr, ROWS: tl.constexpr,
                          ALIGN_ELEMS: tl.constexpr, ALIGN_BYTES: tl.constexpr, TO_HOST: tl.constexpr):
        i = tl.program_id(0)
        layer = layer0.to(tl.int64) + tl.program_id(1)
        t = tl.program_id(2)
        b = tl.load(block_idx_ptr + i).to(tl.int64)
        h = tl.load(page_idx_ptr + i).to(tl.int64)
        runs = t.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rm = runs < num_runs
        w = tl.arange(0, RUN_BLOCK)
        m = rm[:, None] & (w < RUN_ELEMS)[None, :]
        elem_ptr = tl.pointer_type(host_ptr.dtype.element_ty)
        # Every address, stride and offset is a multiple of ALIGN_BYTES (the caller
        # checked): said here so the rows move in vector loads and stores.
        base = tl.multiple_of(tl.load(base_ptrs + layer).to(elem_ptr), ALIGN_BYTES)
        dev_row = tl.multiple_of(b * block_stride + tl.load(run_offs_ptr + runs, mask=rm, other=0), ALIGN_ELEMS)
        host_row = tl.multiple_of(h * page_elems + layer * layer_elems + runs * RUN_ELEMS, ALIGN_ELEMS)
        dev = base + dev_row[:, None] + w[None, :]
        host = host_ptr + host_row[:, None] + w[None, :]
        if TO_HOST:
            tl.store(host, tl.load(dev, mask=m), mask=m)
        else:
            tl.store(dev, tl.load(host, mask=m), mask=m)

    return SimpleNamespace(load_layer=load_layer_kernel, backup=backup_kernel, block_runs=block_runs_kernel)


def _blocks(geom: PageGeometry) -> int:
    return -(-max(geom.k_elems, geom.v_elems) // _BLOCK)


def load_layer_triton(host: torch.Tensor, dev_k: torch.Tensor, dev_v: torch.Tensor | None,
                      host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int,
                      geom: PageGeometry) -> None:
    """Same contract as `copy.load_layer_torch`, except both page-id tensors live on
    the pool's device (the kernel reads them there)."""
    n = host_pages.numel()
    if n == 0:
        return
    k = _kernels()
    k.load_layer[(n, _blocks(geom))](
        host, dev_k, dev_k if dev_v is None else dev_v, host_pages, device_pages, layer,
        geom.page_elems, geom.layer_bytes // geom.width, geom.k_elems, geom.v_elems,
        HAS_V=dev_v is not None, BLOCK=_BLOCK)


def pointer_table(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Addresses of per-layer pool buffers, as the int64 table `backup_all_layers_triton` reads."""
    if any(b.data_ptr() % 16 for b in buffers):
        raise ValueError("pool buffers must start 16-byte aligned for the backup kernel")
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)


def backup_all_layers_triton(host: torch.Tensor, k_ptrs: torch.Tensor, v_ptrs: torch.Tensor | None,
                             host_pages: torch.Tensor, device_pages: torch.Tensor,
                             geom: PageGeometry) -> None:
    """Same contract as `copy.backup_all_layers_torch`, with the pool's buffers given as
    `pointer_table`s (the buffers must stay alive) and page ids on the pool's device."""
    n = host_pages.numel()
    if n == 0:
        return
    k = _kernels()
    k.backup[(n, geom.num_layers, _blocks(geom))](
        host, k_ptrs, k_ptrs if v_ptrs is None else v_ptrs, host_pages, device_pages,
        geom.page_elems, geom.layer_bytes // geom.width, geom.k_elems, geom.v_elems,
        HAS_V=v_ptrs is not None, BLOCK=_BLOCK)


@dataclass(frozen=True, slots=True)
class RunGeometry:
    """The runs of one layer's blocks in units of `width` bytes, as `copy_block_runs`
    reads them: block `b` of a layer is the runs at `base + b * block_stride +
    run_offs[j]`, `run_elems` each, kept back to back in the layer's part of a page."""

    width: int  # bytes per copied element
    run_elems: int
    block_stride: int
    num_runs: int
    page_elems: int
    layer_elems: int
    align_bytes: int  # every address, stride and offset is a multiple of this

    @property
    def dtype(self) -> torch.dtype:
        return wide_dtype(self.width)[0]


def copy_block_runs(host: torch.Tensor, base_ptrs: torch.Tensor, run_offs: torch.Tensor,
                    block_ids: torch.Tensor, host_pages: torch.Tensor, layer0: int, num_layers: int,
                    geom: RunGeometry, *, to_host: bool) -> None:
    """Layers `layer0 .. layer0 + num_layers - 1` of blocks `block_ids` <-> host pages
    `host_pages` (to the host when `to_host`). `host` is the arena as `[slots,
    page_elems]` in `geom.dtype`; `base_ptrs` the layers' tensor addresses and
    `run_offs` the run offsets (elements), int64 tables like the id tensors on the
    device the kernel runs on. Trusts its ids: BlockCopier validates them."""
    n = block_ids.numel()
    if n == 0 or num_layers == 0:
        return
    run_block = triton_next_pow2(geom.run_elems)
    rows = max(1, _BLOCK // run_block)
    tiles = -(-geom.num_runs // rows)
    _kernels().block_runs[(n, num_layers, tiles)](
        host, base_ptrs, run_offs, block_ids, host_pages, layer0,
        geom.block_stride, geom.page_elems, geom.layer_elems, geom.num_runs,
        RUN_ELEMS=geom.run_elems, RUN_BLOCK=run_block, ROWS=rows,
        ALIGN_ELEMS=geom.align_bytes // geom.width, ALIGN_BYTES=geom.align_bytes, TO_HOST=to_host)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
