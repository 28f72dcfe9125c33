"""Triton kernels for batch slot allocation; `alloc.py` is their torch twin and
the specification (the results must be `torch.equal`).

One program per request. Each program computes its own exclusive prefix sums
(output offset, first new page) with a runtime loop over the requests before
it, and writes its tokens with a runtime loop over blocks of its extend
length. Only the page size and block sizes are `constexpr`, so one compilation
serves every batch size and extend length; the input pointers are not
specialized on alignment because the allocator re-slices `free_pages` (and
engines pass slices of their own tensors), which would otherwise flip the
16-byte-divisibility key and compile a second variant.

Triton is imported on first use, never at module import: this module loads
on machines without Triton, and the kernels see `TRITON_INTERPRET` as it is
when they are first built.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from hicache.kernels.triton_env import device_supported

logger = logging.getLogger(__name__)

# Requests summed per loop step of the in-kernel prefix sum; with 512, a batch
# of up to 512 requests needs one step per program.
_BLOCK_BS = 512
# Output tokens written per loop step.
_BLOCK_TOK = 1024


def triton_usable(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`: CUDA, or CPU under
    the interpreter; and Triton imports."""
    if not device_supported(device):
        return False
    try:
        _kernels()
    except Exception as e:  # absent, or present but broken (driver, ABI)
        logger.warning("triton is unusable for the allocation kernels: %s", e)
        return False
    return True


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    _unspecialized = ["prefix_lens_ptr", "seq_lens_ptr", "last_loc_ptr", "free_pages_ptr"]

    @triton.jit(do_not_specialize=_unspecialized)
    def alloc_extend_kernel(
        prefix_lens_ptr,
        seq_lens_ptr,
        last_loc_ptr,
        free_pages_ptr,
        out_ptr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_BS: tl.constexpr,
        BLOCK_TOK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)

        # Exclusive prefix sums over requests 0 .. pid-1, accumulated lane-wise
        # and reduced once.
        lanes = tl.arange(0, BLOCK_BS)
        extend_acc = tl.zeros((BLOCK_BS,), dtype=tl.int64)
        pages_acc = tl.zeros((BLOCK_BS,), dtype=tl.int64)
        for blk in range(0, tl.cdiv(pid, BLOCK_BS)):
            req = blk * BLOCK_BS + lanes
            before = req < pid
            pre = tl.load(prefix_lens_ptr + req, mask=before, other=0)
            seq = tl.load(seq_lens_ptr + req, mask=before, other=0)
            extend_acc += seq - pre
            pages_acc += (seq + PAGE_SIZE - 1) // PAGE_SIZE - (pre + PAGE_SIZE - 1) // PAGE_SIZE
        out_start = tl.sum(extend_acc, axis=0)
        page_start = tl.sum(pages_acc, axis=0)

        prefix_len = tl.load(prefix_lens_ptr + pid)
        seq_len = tl.load(seq_lens_ptr + pid)
        last_loc = tl.load(last_loc_ptr + pid)
        extend_len = seq_len - prefix_len
        pages_before = (prefix_len + PAGE_SIZE - 1) // PAGE_SIZE
        # Tokens that still fit in the page holding the last prefix token.
        num_part1 = tl.minimum(seq_len, pages_before * PAGE_SIZE) - prefix_len

        toks = tl.arange(0, BLOCK_TOK)
        for blk in range(0, tl.cdiv(extend_len, BLOCK_TOK)):
            k = blk * BLOCK_TOK + toks
            live = k < extend_len
            fresh = k >= num_part1
            pos = prefix_len + k
            page = tl.load(
                free_pages_ptr + page_start + pos // PAGE_SIZE - pages_before,
                mask=live & fresh,
                other=0,
            )
            slot = tl.where(fresh, page * PAGE_SIZE + pos % PAGE_SIZE, last_loc + 1 + k)
            tl.store(out_ptr + out_start + k, slot, mask=live)

    @triton.jit(do_not_specialize=["seq_lens_ptr", "last_loc_ptr", "free_pages_ptr"])
    def alloc_decode_kernel(
        seq_lens_ptr,
        last_loc_ptr,
        free_pages_ptr,
        out_ptr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_BS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)

        # Pages opened by requests 0 .. pid-1.
        lanes = tl.arange(0, BLOCK_BS)
        pages_acc = tl.zeros((BLOCK_BS,), dtype=tl.int64)
        for blk in range(0, tl.cdiv(pid, BLOCK_BS)):
            req = blk * BLOCK_BS + lanes
            before = req < pid
            seq = tl.load(seq_lens_ptr + req, mask=before, other=1)
            opens = before & ((seq - 1) % PAGE_SIZE == 0)
            pages_acc += opens.to(tl.int64)
        page_start = tl.sum(pages_acc, axis=0)

        seq_len = tl.load(seq_lens_ptr + pid)
        if (seq_len - 1) % PAGE_SIZE == 0:
            page = tl.load(free_pages_ptr + page_start)
            tl.store(out_ptr + pid, page * PAGE_SIZE)
        else:
            last_loc = tl.load(last_loc_ptr + pid)
            tl.store(out_ptr + pid, last_loc + 1)

    return SimpleNamespace(extend=alloc_extend_kernel, decode=alloc_decode_kernel)


def alloc_extend_triton(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    num_tokens: int,
    *,
    block_bs: int = _BLOCK_BS,
    block_tok: int = _BLOCK_TOK,
) -> torch.Tensor:
    """Same result as `alloc_extend_torch(...)[0]`. The caller passes
    `num_tokens` (= sum of seq - prefix) and guarantees `free_pages` holds at
    least the new pages needed: the kernel reads without bounds. The block
    sizes (powers of two) are tunables; tests shrink them to run the loops
    for several steps."""
    out = torch.empty((num_tokens,), dtype=torch.int64, device=seq_lens.device)
    bs = seq_lens.numel()
    if bs == 0 or num_tokens == 0:
        return out
    _kernels().extend[(bs,)](
        prefix_lens.contiguous(),
        seq_lens.contiguous(),
        last_loc.contiguous(),
        free_pages,
        out,
        PAGE_SIZE=page_size,
        BLOCK_BS=block_bs,
        BLOCK_TOK=block_tok,
    )
    return out


def alloc_decode_triton(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    block_bs: int = _BLOCK_BS,
) -> torch.Tensor:
    """Same result as `alloc_decode_torch(...)[0]`; the same contract as
    `alloc_extend_triton`."""
    bs = seq_lens.numel()
    out = torch.empty((bs,), dtype=torch.int64, device=seq_lens.device)
    if bs == 0:
        return out
    _kernels().decode[(bs,)](
        seq_lens.contiguous(),
        last_loc.contiguous(),
        free_pages,
        out,
        PAGE_SIZE=page_size,
        BLOCK_BS=block_bs,
    )
    return out
