"""Token-slot allocators for the device KV pool (SGLang's
`TokenToKVPoolAllocator` / `PagedTokenToKVPoolAllocator`).

The allocator owns the free list of device pages `1 .. num_pages` (page 0 is
the pool's padding page) and hands out token slots: page `p` holds slots
`[p * page_size, (p + 1) * page_size)`. `free_pages` is an int64 tensor on the
pool's device; taking pages slices its front, freeing puts pages back at the
front, so recently freed (warm) pages are reused first.

Contracts:
- Scarcity is a return value: an allocation that does not fit returns None
  and changes nothing.
- Misuse raises `AllocatorError` (a `ValueError`) and changes nothing: shape
  or dtype mismatches, `seq_len < prefix_len`, a `last_loc` that does not sit
  in a held page at the offset its length implies, freeing padding or
  out-of-range slots, and double frees. A boolean page-free mask makes the
  double-free check one vectorized gather.
- Each call validates and sizes its work with one device-to-host read of a
  few counters (`free` adds one for the variable-size page list), so one or
  two syncs on CUDA; the slot computation itself is a single kernel (Triton)
  or a handful of vectorized ops (torch twin), never a per-request Python loop.
- Not thread-safe: one owner (the scheduler loop) calls it.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from typing import Literal

import torch

from hicache.errors import HiCacheError
from hicache.kernels.alloc import alloc_decode_torch, alloc_extend_torch, num_new_pages_extend
from hicache.kernels.alloc_triton import alloc_decode_triton, alloc_extend_triton, triton_usable

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
IndexLike = torch.Tensor | Sequence[int]


class AllocatorError(HiCacheError, ValueError):
    """An allocator call with invalid arguments; the allocator is unchanged."""


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if backend == "triton":
        if not triton_usable(device):
            raise AllocatorError(
                f"backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"device is {device}"
            )
        return "triton"
    raise AllocatorError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class PagedTokenToKVPoolAllocator:
    """Hands out token slots whole pages at a time; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        device: str | torch.device = "cpu",
        backend: Backend = "auto",
    ) -> None:
        if not _is_int(page_size) or page_size < 1:
            raise AllocatorError(f"page_size must be a positive int, not {page_size!r}")
        if not _is_int(num_slots) or num_slots <= 0 or num_slots % page_size:
            raise AllocatorError(f"num_slots must be a positive multiple of page_size={page_size}, not {num_slots!r}")
        self.page_size = int(page_size)
        self.num_slots = int(num_slots)
        self.num_pages = self.num_slots // self.page_size
        self.device = torch.device(device)
        # Chosen once: the hot paths branch on a bool, never probe again.
        self.backend = _resolve_backend(backend, self.device)
        self._use_triton = self.backend == "triton"
        self._slot_in_page = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()
        logger.debug("allocator: %d pages of %d slots on %s, %s backend",
                     self.num_pages, page_size, self.device, self.backend)

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Every page free again; any open free group is dropped."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        # Indexed by page id; page 0 (padding) is never free.
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._page_free[0] = False
        # Pages freed inside an open group, not yet back on the free list.
        self._page_pending = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._free_group: list[torch.Tensor] | None = None

    @property
    def num_free_pages(self) -> int:
        return self.free_pages.numel()

    def available_size(self) -> int:
        """Free capacity in tokens (pages pending in an open free group excluded)."""
        return self.free_pages.numel() * self.page_size

    # ------------------------------------------------------------- allocation

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Slots of `need_size // page_size` whole pages (page after page), or
        None when they are not free. `need_size` must be a multiple of page_size."""
        if not _is_int(need_size) or need_size < 0 or need_size % self.page_size:
            raise AllocatorError(f"need_size must be a non-negative multiple of page_size={self.page_size}, "
                                 f"not {need_size!r}")
        num_pages = int(need_size) // self.page_size
        if num_pages > self.free_pages.numel():
            return None
        pages = self._take(num_pages)
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._slot_in_page).reshape(-1)

    def alloc_extend(self, prefix_lens: IndexLike, seq_lens: IndexLike, last_loc: IndexLike) -> torch.Tensor | None:
        """Slots for tokens `prefix_len .. seq_len-1` of every request,
        concatenated in request order: first the rest of the page holding
        `last_loc` (the slot of the request's last prefix token), then new
        pages. None when the new pages are not free."""
        prefix = self._lens(prefix_lens, "prefix_lens")
        seq = self._lens(seq_lens, "seq_lens")
        last = self._lens(last_loc, "last_loc")
        if not prefix.shape == seq.shape == last.shape:
            raise AllocatorError(f"prefix_lens, seq_lens, last_loc differ in shape: "
                                 f"{tuple(prefix.shape)}, {tuple(seq.shape)}, {tuple(last.shape)}")
        if seq.numel() == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        ps = self.page_size
        extend = seq - prefix
        new_pages = num_new_pages_extend(prefix, seq, ps)
        # last_loc matters only where the prefix ends inside a page and tokens follow.
        uses_last = (prefix % ps != 0) & (extend > 0)
        checks = torch.stack([
            (prefix < 0).sum(),
            (extend < 0).sum(),
            self._count_bad_last_loc(uses_last, last, prefix % ps),
            extend.sum(),
            new_pages.sum(),
        ]).tolist()
        n_neg, n_short, n_bad_last, num_tokens, num_new = checks
        if n_neg:
            raise AllocatorError(f"prefix_lens must be >= 0 (request {self._first(prefix < 0)})")
        if n_short:
            raise AllocatorError(f"seq_lens must be >= prefix_lens (request {self._first(extend < 0)})")
        if n_bad_last:
            raise AllocatorError(
                f"last_loc must be a slot of a held page with (last_loc + 1) % page_size == prefix_len % page_size "
                f"(request {self._first(uses_last & self._bad_last_loc_mask(last, prefix % ps))})")
        if num_new > self.free_pages.numel():
            return None
        if ps == 1:
            out = self.free_pages[:num_tokens]  # every token opens a page
        elif self._use_triton:
            out = alloc_extend_triton(prefix, seq, last, self.free_pages, ps, num_tokens)
        else:
            out, _ = alloc_extend_torch(prefix, seq, last, self.free_pages, ps, num_tokens)
        self._take(num_new)
        return out

    def alloc_decode(self, seq_lens: IndexLike, last_loc: IndexLike) -> torch.Tensor | None:
        """One slot per request for its next token; `seq_lens` count that
        token. `last_loc + 1` unless the token opens a page. None when the
        new pages are not free."""
        seq = self._lens(seq_lens, "seq_lens")
        last = self._lens(last_loc, "last_loc")
        if seq.shape != last.shape:
            raise AllocatorError(f"seq_lens, last_loc differ in shape: {tuple(seq.shape)}, {tuple(last.shape)}")
        if seq.numel() == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        ps = self.page_size
        prev_offset = (seq - 1) % ps
        uses_last = prev_offset != 0
        n_empty, n_bad_last, num_new = torch.stack([
            (seq < 1).sum(),
            self._count_bad_last_loc(uses_last, last, prev_offset),
            (~uses_last).sum(),
        ]).tolist()
        if n_empty:
            raise AllocatorError(f"seq_lens must be >= 1, they include the new token (request {self._first(seq < 1)})")
        if n_bad_last:
            raise AllocatorError(
                f"last_loc must be a slot of a held page with (last_loc + 1) % page_size == (seq_len - 1) % page_size "
                f"(request {self._first(uses_last & self._bad_last_loc_mask(last, prev_offset))})")
        if num_new > self.free_pages.numel():
            return None
        if ps == 1:
            out = self.free_pages[:num_new]
        elif self._use_triton:
            out = alloc_decode_triton(seq, last, self.free_pages, ps)
        else:
            out, _ = alloc_decode_torch(seq, last, self.free_pages, ps)
        self._take(num_new)
        return out

    # ---------------------------------------------------------------- freeing

    def free(self, slot_indices: IndexLike) -> None:
        """Free the pages the given slots belong to. Slots name pages: a page
        named several times in one call (several of its slots, or one slot
        twice) is freed once. Inside a free group the pages are held back
        until `free_group_end`."""
        slots = self._index(slot_indices, "slot_indices").reshape(-1)
        if slots.numel() == 0:
            return
        ps = self.page_size
        end = (self.num_pages + 1) * ps
        pages = self._distinct_pages(slots.clamp(0, end - 1) // ps)
        n_pad, n_out, n_double = torch.stack([
            ((slots >= 0) & (slots < ps)).sum(),
            ((slots < 0) | (slots >= end)).sum(),
            (self._page_free[pages] | self._page_pending[pages]).sum(),
        ]).tolist()
        if n_pad:
            raise AllocatorError(f"slots 0..{ps - 1} are the padding page and never allocated")
        if n_out:
            raise AllocatorError(f"slot out of range [{ps}, {end})")
        if n_double:
            raise AllocatorError(f"double free: {n_double} page(s) already free")
        if self._free_group is not None:
            self._page_pending[pages] = True
            self._free_group.append(pages)
        else:
            self._release(pages)

    def free_group_begin(self) -> None:
        """Collect the following frees and return them in one step (one
        concatenation instead of one per finished request)."""
        if self._free_group is not None:
            raise AllocatorError("a free group is already open")
        self._free_group = []

    def free_group_end(self) -> None:
        if self._free_group is None:
            raise AllocatorError("no free group is open")
        group, self._free_group = self._free_group, None
        if group:
            # Disjoint by construction: free() rejects pages already pending.
            pages = torch.cat(group)
            self._page_pending[pages] = False
            self._release(pages)

    # ---------------------------------------------------------------- helpers

    def _take(self, num_pages: int) -> torch.Tensor:
        pages = self.free_pages[:num_pages]
        self._page_free[pages] = False
        self.free_pages = self.free_pages[num_pages:]
        return pages

    def _release(self, pages: torch.Tensor) -> None:
        self._page_free[pages] = True
        self.free_pages = torch.cat((pages, self.free_pages))

    def _distinct_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Distinct page ids in ascending order. Short lists sort; long ones
        (a finished prefill) go through a page mask, O(n + num_pages), no sort."""
        if pages.numel() * 16 < self.num_pages:
            return torch.unique(pages)
        named = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        named[pages] = True
        return named.nonzero().squeeze(1)

    def _bad_last_loc_mask(self, last: torch.Tensor, want_offset: torch.Tensor) -> torch.Tensor:
        """True where `last` is not a slot of a held page at `want_offset - 1`."""
        page = last // self.page_size
        in_range = (page >= 1) & (page <= self.num_pages)
        idx = page.clamp(0, self.num_pages)
        held = ~(self._page_free[idx] | self._page_pending[idx])
        return ~(in_range & held & ((last + 1) % self.page_size == want_offset))

    def _count_bad_last_loc(self, uses: torch.Tensor, last: torch.Tensor, want_offset: torch.Tensor) -> torch.Tensor:
        return (uses & self._bad_last_loc_mask(last, want_offset)).sum()

    @staticmethod
    def _first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    def _index(self, x: IndexLike, name: str) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        if t.numel() == 0:
            t = t.to(torch.int64)  # an empty list reads as float32
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise AllocatorError(f"{name} must hold integers, not {t.dtype}")
        return t.to(device=self.device, dtype=torch.int64)

    def _lens(self, x: IndexLike, name: str) -> torch.Tensor:
        t = self._index(x, name)
        if t.dim() != 1:
            raise AllocatorError(f"{name} must be 1-D, not shaped {tuple(t.shape)}")
        return t


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The page_size=1 allocator: slots `1 .. num_slots`, slot 0 is padding.
    `alloc_extend` / `alloc_decode` reduce to taking one slot per new token."""

    def __init__(self, num_slots: int, device: str | torch.device = "cpu", backend: Backend = "auto") -> None:
        super().__init__(num_slots, 1, device, backend)
