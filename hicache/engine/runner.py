"""A small engine around TinyTransformer: request state, slot tables, prefill, decode.

The memory flow is SGLang's (seeds/000, sections 1-3 and 7): a request takes a
row of the `ReqToTokenPool`; its cached prefix slots (resident already, or just
loaded by hicache) are written into the row; the allocator's `alloc_extend`
hands out slots for the rest; the model writes their KV while it runs. Decode
takes one slot per request from `alloc_decode`.

Ownership: prefix slots are lent by the caller (a radix cache, hicache) and
never freed here; `free(request, keep=n)` returns the slots the engine
allocated, except those of the first `n` tokens, which pass to the caller (to
be inserted into its cache). Running out of slots or rows is a return value
(`None`) with no state changed, so the caller can evict and retry.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.engine.attention import EngineError, ForwardBatch
from hicache.engine.model import LayerHook, TinyTransformer
from hicache.errors import LayoutError
from hicache.tiers.device.pool import DevicePool

logger = logging.getLogger(__name__)


class SlotAllocator(Protocol):
    """What the engine needs of `hicache.tiers.device.allocator.PagedTokenToKVPoolAllocator`."""

    page_size: int

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None: ...

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None: ...

    def free(self, slot_indices: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


class ReqToTokenPool:
    """Request -> token slot table: `req_to_token[row, i]` is the pool slot of
    token `i` of the request holding `row`."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise EngineError("ReqToTokenPool needs size > 0 and max_context_len > 0")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(size))

    def alloc(self, need: int) -> list[int] | None:
        if need > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:need], self._free_rows[need:]
        return rows

    def free(self, rows: Sequence[int]) -> None:
        self._free_rows.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start:start + slots.numel()] = slots

    def available_size(self) -> int:
        return len(self._free_rows)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. `token_ids` holds every known token (prompt, then the
    generated ones the caller appended); the first `seq_len` have KV in the pool."""

    token_ids: list[int]
    row: int = -1  # ReqToTokenPool row; -1 while not resident
    seq_len: int = 0
    prefix_len: int = 0  # leading tokens whose slots the caller lent
    _table_row: torch.Tensor | None = field(default=None, repr=False)

    @property
    def resident(self) -> bool:
        return self.row >= 0

    @property
    def slots(self) -> torch.Tensor:
        """Pool slots of the first `seq_len` tokens (a view of the table row)."""
        if self._table_row is None:
            return torch.empty(0, dtype=torch.int64)
        return self._table_row[:self.seq_len]

    def _reset(self) -> None:
        self.row, self.seq_len, self.prefix_len, self._table_row = -1, 0, 0, None


class Engine:
    def __init__(self, model: TinyTransformer, device_pool: DevicePool, allocator: SlotAllocator,
                 max_requests: int = 64, max_context_len: int | None = None) -> None:
        expected = model.layout(device_pool.page_size)
        if device_pool.layout != expected:
            raise LayoutError(f"pool layout {device_pool.layout} does not match the model's {expected}")
        if getattr(allocator, "page_size", device_pool.page_size) != device_pool.page_size:
            raise LayoutError(f"allocator page_size {allocator.page_size} != pool page_size {device_pool.page_size}")
        self.model = model
        self.pool = device_pool
        self.allocator = allocator
        self.page_size = device_pool.page_size
        self.max_context_len = max_context_len or model.config.max_positions
        if self.max_context_len > model.config.max_positions:
            raise EngineError("max_context_len exceeds the model's max_positions")
        self.req_to_token_pool = ReqToTokenPool(max_requests, self.max_context_len, device_pool.device)

    # -- prefill ----------------------------------------------------------
    def prefill(self, requests: Sequence[Request], prefix_slots: Sequence[torch.Tensor] | None = None,
                layer_hook: LayerHook | None = None) -> torch.Tensor | None:
        """Make `requests` resident and run their non-prefix tokens.

        `prefix_slots[i]` lists the slots already holding the KV of the first
        `len(prefix_slots[i])` tokens of request `i` (whole pages, fewer than
        its tokens; empty for none). If the prefix is still being loaded,
        `layer_hook(l)` must wait for layer `l`. Returns logits `[len(requests),
        vocab]` of each request's last token, or None when rows or slots ran
        out (nothing changed).
        """
        self._check_batch(requests)
        if any(r.resident for r in requests):
            raise EngineError("prefill takes requests that are not resident yet")
        if prefix_slots is None:
            prefix_slots = [torch.empty(0, dtype=torch.int64)] * len(requests)
        if len(prefix_slots) != len(requests):
            raise EngineError(f"{len(requests)} requests but {len(prefix_slots)} prefix slot lists")
        prefixes = [self._check_prefix(r, p) for r, p in zip(requests, prefix_slots)]

        rows = self.req_to_token_pool.alloc(len(requests))
        if rows is None:
            logger.debug("prefill: no free request rows for %d requests", len(requests))
            return None
        dev = self.pool.device
        prefix_lens = torch.tensor([p.numel() for p in prefixes], dtype=torch.int64, device=dev)
        seq_lens = torch.tensor([len(r.token_ids) for r in requests], dtype=torch.int64, device=dev)
        last_loc = torch.tensor([int(p[-1]) if p.numel() else -1 for p in prefixes], dtype=torch.int64, device=dev)
        new_slots = self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc)
        if new_slots is None:
            self.req_to_token_pool.free(rows)
            logger.debug("prefill: out of KV slots for %d tokens", int((seq_lens - prefix_lens).sum()))
            return None

        table = self.req_to_token_pool
        offset = 0
        for req, row, prefix in zip(requests, rows, prefixes):
            n_new = len(req.token_ids) - prefix.numel()
            table.write(row, 0, prefix)
            table.write(row, prefix.numel(), new_slots[offset:offset + n_new])
            offset += n_new
            req.row, req.seq_len, req.prefix_len = row, len(req.token_ids), prefix.numel()
            req._table_row = table.req_to_token[row]
        tokens = [self._tokens(r.token_ids[r.prefix_len:]) for r in requests]
        try:
            batch = ForwardBatch.build(tokens, [r.slots for r in requests])
            return self.model.forward(batch, self.pool, layer_hook)
        except BaseException:
            # The step did not happen: give back what it took.
            self.allocator.free(new_slots)
            table.free(rows)
            for req in requests:
                req._reset()
            raise

    # -- decode -----------------------------------------------------------
    def decode(self, requests: Sequence[Request], layer_hook: LayerHook | None = None) -> torch.Tensor | None:
        """Run one pending token per resident request (the caller appended it
        to `token_ids`). Returns logits `[len(requests), vocab]`, or None when
        slots ran out (nothing changed)."""
        self._check_batch(requests)
        for req in requests:
            if not req.resident:
                raise EngineError("decode takes resident requests (prefill them first)")
            if len(req.token_ids) != req.seq_len + 1:
                raise EngineError(f"decode needs exactly one pending token, request has "
                                  f"{len(req.token_ids) - req.seq_len}")
            if req.seq_len + 1 > self.max_context_len:
                raise EngineError(f"request would exceed max_context_len {self.max_context_len}")
        dev = self.pool.device
        table = self.req_to_token_pool.req_to_token
        rows = torch.tensor([r.row for r in requests], dtype=torch.int64, device=dev)
        cur = torch.tensor([r.seq_len for r in requests], dtype=torch.int64, device=dev)
        new_slots = self.allocator.alloc_decode(cur + 1, table[rows, cur - 1])
        if new_slots is None:
            logger.debug("decode: out of KV slots for %d requests", len(requests))
            return None
        table[rows, cur] = new_slots
        for req in requests:
            req.seq_len += 1
        tokens = [self._tokens(r.token_ids[-1:]) for r in requests]
        try:
            batch = ForwardBatch.build(tokens, [r.slots for r in requests])
            return self.model.forward(batch, self.pool, layer_hook)
        except BaseException:
            self.allocator.free(new_slots)
            for req in requests:
                req.seq_len -= 1
            raise

    # -- release ----------------------------------------------------------
    def free(self, request: Request, keep: int = 0) -> None:
        """Release `request`: free the slots the engine allocated for it except
        those of its first `keep` tokens (they pass to the caller), and its row.
        `keep` is a page boundary or the whole sequence; lent prefix slots are
        never freed."""
        if not request.resident:
            raise EngineError("request is not resident")
        if not 0 <= keep <= request.seq_len or (keep % self.page_size and keep != request.seq_len):
            raise EngineError(f"keep must be a page boundary within 0..{request.seq_len}, got {keep}")
        start = max(keep, request.prefix_len)
        if start < request.seq_len:
            # Paged allocators free whole pages; start is page-aligned, so only this request's pages go.
            self.allocator.free(request.slots[start:].clone())
        self.req_to_token_pool.free([request.row])
        request._reset()

    # -- convenience ------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 prefix_slots: torch.Tensor | None = None) -> list[int] | None:
        """Greedy decoding of `max_new_tokens` tokens after `prompt`. Returns
        None if the pool ran out at any step; everything the call allocated is
        freed either way."""
        if max_new_tokens < 1:
            raise EngineError("max_new_tokens must be >= 1")
        if len(prompt) + max_new_tokens - 1 > self.max_context_len:
            raise EngineError(f"prompt + new tokens exceed max_context_len {self.max_context_len}")
        req = Request(list(prompt))
        logits = self.prefill([req], None if prefix_slots is None else [prefix_slots])
        if logits is None:
            return None
        out: list[int] = []
        try:
            while True:
                token = int(logits[0].argmax())
                out.append(token)
                if len(out) == max_new_tokens:
                    return out
                req.token_ids.append(token)
                logits = self.decode([req])
                if logits is None:
                    return None
        finally:
            self.free(req)

    # -- checks -----------------------------------------------------------
    def _check_batch(self, requests: Sequence[Request]) -> None:
        if not requests:
            raise EngineError("empty batch")
        if len({id(r) for r in requests}) != len(requests):
            raise EngineError("a request appears twice in one batch")

    def _check_prefix(self, req: Request, prefix: torch.Tensor) -> torch.Tensor:
        n_tokens = len(req.token_ids)
        if not 1 <= n_tokens <= self.max_context_len:
            raise EngineError(f"a prompt has 1..{self.max_context_len} tokens, got {n_tokens}")
        vocab = self.model.config.vocab_size
        if min(req.token_ids) < 0 or max(req.token_ids) >= vocab:
            raise EngineError(f"token ids must lie in 0..{vocab - 1}")
        prefix = torch.as_tensor(prefix, dtype=torch.int64, device=self.pool.device)
        n = prefix.numel()
        if prefix.dim() != 1 or n % self.page_size or n >= n_tokens:
            raise EngineError(f"a prefix is whole pages of size {self.page_size} and shorter than the "
                              f"prompt ({n_tokens} tokens), got {tuple(prefix.shape)}")
        if n:
            pages = prefix.view(-1, self.page_size)
            step = torch.arange(self.page_size, device=prefix.device)
            first = pages[:, 0]
            if (bool((pages != first[:, None] + step).any()) or bool((first % self.page_size).any())
                    or int(first.min()) < self.page_size or int(first.max()) > self.pool.num_slots):
                raise EngineError("prefix slots must be whole device pages 1..num_pages, in order")
        return prefix

    def _tokens(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.model.device)
