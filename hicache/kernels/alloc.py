"""Slot allocation for a batch of requests: the vectorized torch twin.

Given per-request `prefix_lens` (tokens already held), `seq_lens` (tokens
held after this step) and `last_loc` (slot of each request's last held
token), hand out token slots for the new tokens of every request at once:

1. first fill the request's old partial page (`last_loc + 1, ...`);
2. then whole new pages;
3. then one new partial page for the tail.

New pages come from `free_pages` in request order: request `i` takes
`free_pages[start_i : start_i + n_i]`, with `start_i` the exclusive prefix sum
of the new-page counts `n`. Page `p` holds slots `[p * page_size, (p + 1) *
page_size)`. These are SGLang's `alloc_extend_kernel` / `alloc_decode_kernel`
semantics; `alloc_triton` holds the GPU kernels, which must match this twin
exactly. Neither consumes `free_pages` nor checks arguments: the allocator
validates, checks capacity, then advances its free list by `num_new_pages`.

Inputs are 1-D int64 tensors on one device, `seq_lens >= prefix_lens >= 0`.
"""

from __future__ import annotations

import torch


def num_new_pages_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Per request, the pages it needs beyond those its prefix already touches."""
    return (seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size


def num_new_pages_decode(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Per request, 1 where the new token (at position `seq_len - 1`) opens a page."""
    return ((seq_lens - 1) % page_size == 0).to(torch.int64)


def alloc_extend_torch(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Slots for tokens `prefix_len .. seq_len-1` of every request, concatenated
    in request order, and the number of pages taken from the front of
    `free_pages`. `num_tokens` (= sum of seq - prefix) may be passed when the
    caller already knows it."""
    extend_lens = seq_lens - prefix_lens
    pages_before = (prefix_lens + page_size - 1) // page_size
    new_pages = (seq_lens + page_size - 1) // page_size - pages_before
    num_new = int(new_pages.sum())
    if num_new > free_pages.numel():
        raise ValueError(f"need {num_new} free pages, {free_pages.numel()} given")
    if num_tokens is None:
        num_tokens = int(extend_lens.sum())
    out_start = torch.cumsum(extend_lens, 0) - extend_lens
    page_start = torch.cumsum(new_pages, 0) - new_pages
    # Tokens that still fit in the page holding each request's last prefix token.
    num_part1 = torch.minimum(seq_lens, pages_before * page_size) - prefix_lens

    # One lane per output token t. Each per-token quantity is t plus a
    # per-request term, so every term is spread over its request's tokens once.
    def per_token(per_request: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(per_request, extend_lens, output_size=num_tokens)

    t = torch.arange(num_tokens, dtype=torch.int64, device=seq_lens.device)
    part1_slot = t + per_token(last_loc + 1 - out_start)
    if num_new == 0:
        return part1_slot, 0
    fresh = t >= per_token(out_start + num_part1)
    pos = t + per_token(prefix_lens - out_start)  # token position in its sequence
    page_in_seq = torch.div(pos, page_size, rounding_mode="floor")
    # The where() keeps part-1 lanes (whose page index would be negative) in range.
    page_idx = torch.where(fresh, per_token(page_start - pages_before) + page_in_seq, 0)
    fresh_slot = free_pages[page_idx] * page_size + (pos - page_in_seq * page_size)
    return torch.where(fresh, fresh_slot, part1_slot), num_new


def alloc_decode_torch(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, int]:
    """One slot per request for its new token; `seq_lens` count that token.
    Returns the slots and the number of pages taken from `free_pages`."""
    new_pages = num_new_pages_decode(seq_lens, page_size)
    num_new = int(new_pages.sum())
    if num_new > free_pages.numel():
        raise ValueError(f"need {num_new} free pages, {free_pages.numel()} given")
    out = last_loc + 1
    if num_new == 0:
        return out, 0
    crosses = new_pages.bool()
    page_start = torch.cumsum(new_pages, 0) - new_pages
    page_idx = torch.where(crosses, page_start, 0)
    return torch.where(crosses, free_pages[page_idx] * page_size, out), num_new
