"""Triton kernels for page copies between the host arena and a device pool;
`copy.py` holds their torch twins (the results must be `torch.equal`).

Both kernels copy in the wide integer dtype of `PageGeometry` and read the
page-first host layout with strides:

- `load_layer`: one layer, host slots -> device pages. Grid `(pages, blocks)`;
  program `(i, b)` copies block `b` of page pair `i`, K and (MHA) V.
- `backup_all_layers`: every layer, device pages -> host slots, in one launch.
  Grid `(pages, layers, blocks)`; the per-layer pool buffers are reached through
  a table of their addresses (built once per pool by the caller).

On CUDA the host arena must be registered (`HostArena.register_cuda`) so the
kernels can address it directly (unified addressing); no staging buffer.

Triton is imported on first use, never at module import: this module loads on
machines without Triton, and the kernels see `TRITON_INTERPRET` as it is when
they are first built (the interpreter runs them on CPU tensors, which is how
the tests check them without a GPU).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from hicache.kernels.copy import PageGeometry
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

    return SimpleNamespace(load_layer=load_layer_kernel, backup=backup_kernel)


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
