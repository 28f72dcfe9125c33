"""Paged attention over the DevicePool, and the batch-invariant contraction it is built on.

Every step writes its new tokens' K/V (or MLA latent) into the pool first and
then attends over the request's *whole* slot list gathered back from the pool,
prefix first, in token order. KV that was loaded into the pool from the host
tier is therefore read exactly like KV computed a moment ago in the same call.

Exactness. hicache promises that a prefix loaded from another tier gives the
same logits as recomputing it: in float32 on CPU, bitwise. That needs every
token's arithmetic to be independent of which other tokens share its batch.
BLAS GEMM does not promise that (MKL takes a GEMV path for one row and other
blockings for a few rows, and the last bits move), so every matmul in the
engine goes through `rowdot`: a broadcast multiply and a sum over the
contiguous last dimension, whose reduction order is fixed by the length of that
dimension alone, whatever the number of rows or threads. It trades BLAS speed
for that guarantee, which is the right trade for a reference engine.

The same must hold along the sequence: a token's KV may have been computed by
an earlier, shorter request (multi-turn reuse) or by a decode step, and must
carry the bits a longer prefill would give it. Softmax and the probs x V sum
reduce over the keys, and their order depends on how many keys there are, so
`causal_attend` never reduces over "the length of this call": queries go in
blocks of `ATTN_BLOCK` positions, and a query at position `p` reduces over
exactly `(p // ATTN_BLOCK + 1) * ATTN_BLOCK` keys, the ones past `p` (future
tokens or zero padding) masked to a weight of exactly zero. Every reduction's
length is then a function of the query's absolute position alone.

The guarantee is a CPU one: CUDA's reduction kernels pick their launch shape from
the number of outputs, so on a GPU the same code is deterministic per shape but
not batch-invariant (tests compare with a tolerance there).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from hicache.errors import HiCacheError
from hicache.tiers.device.pool import DevicePool

# Upper bound on the broadcast product `rowdot` materializes per chunk (elements).
MAX_PRODUCT_ELEMS = 1 << 22
# Query positions per attention block; a query at position p attends over
# (p // ATTN_BLOCK + 1) * ATTN_BLOCK keys. Part of the numerics: changing it
# changes the bits of every KV cached so far.
ATTN_BLOCK = 64


class EngineError(HiCacheError):
    """Misuse of the reference engine: malformed batch, foreign request, bad prefix."""


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a[..., m, k] . b[..., n, k]^T -> [..., m, n]`, batch-invariant.

    Each output element is one inner reduction over `k`, done by torch's
    contiguous inner-sum loop: its order depends on `k` only, so row `i` of the
    result is bitwise the same whether `a` holds 1 row or 1000. Rows are
    processed in chunks to bound the broadcast product; chunking cannot change
    any row's value for the same reason.
    """
    if a.shape[-1] != b.shape[-1]:
        raise EngineError(f"rowdot: contraction dims differ ({a.shape[-1]} vs {b.shape[-1]})")
    a = a.contiguous()
    b = b.contiguous().unsqueeze(-3)
    m = a.shape[-2]
    per_row = max(1, math.prod(b.shape[:-3]) * b.shape[-2] * b.shape[-1])
    step = max(1, MAX_PRODUCT_ELEMS // per_row)
    parts = []
    for start in range(0, m, step):
        # .contiguous() pins k as the innermost stride, i.e. the inner-sum path.
        prod = (a[..., start:start + step, :].unsqueeze(-2) * b).contiguous()
        parts.append(prod.sum(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One forward step over several requests (SGLang's ForwardBatch, reduced).

    The new tokens of all requests are concatenated request-major. Request `i`
    has `extend_lens[i]` new tokens, which are the last tokens of its sequence;
    `seq_slots[i]` lists the pool slots of its whole sequence (cached prefix,
    then the new tokens), so `out_slots` is the concatenation of their tails.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_slots: torch.Tensor  # [T] int64, pool slot receiving each new token's KV
    seq_slots: tuple[torch.Tensor, ...]  # per request: [seq_len] int64 slots, token order
    extend_lens: tuple[int, ...]  # per request: number of new tokens (>= 1)
    max_seq_len: int

    @classmethod
    def build(cls, new_tokens: Sequence[torch.Tensor], seq_slots: Sequence[torch.Tensor]) -> ForwardBatch:
        if not new_tokens or len(new_tokens) != len(seq_slots):
            raise EngineError("a batch needs one token tensor and one slot list per request, at least one request")
        ext, seq_lens = [], []
        for toks, slots in zip(new_tokens, seq_slots):
            if toks.dim() != 1 or slots.dim() != 1:
                raise EngineError("tokens and slot lists must be 1-D")
            if not 1 <= toks.numel() <= slots.numel():
                raise EngineError(f"a request extends by 1..seq_len tokens, got {toks.numel()} of {slots.numel()}")
            ext.append(toks.numel())
            seq_lens.append(slots.numel())
        device = new_tokens[0].device
        positions = torch.cat([torch.arange(s - n, s, device=device) for s, n in zip(seq_lens, ext)])
        out_slots = torch.cat([slots[slots.numel() - n:] for slots, n in zip(seq_slots, ext)])
        return cls(
            input_ids=torch.cat(list(new_tokens)).to(torch.int64),
            positions=positions,
            out_slots=out_slots.to(torch.int64),
            seq_slots=tuple(s.to(torch.int64) for s in seq_slots),
            extend_lens=tuple(ext),
            max_seq_len=max(seq_lens),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def last_index(self) -> torch.Tensor:
        """Index of each request's last new token in the flat batch."""
        ends = torch.tensor(self.extend_lens, device=self.input_ids.device).cumsum(0)
        return ends - 1

    def segments(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start of the request's new tokens in the batch, their count, all its slots)."""
        start = 0
        for n, slots in zip(self.extend_lens, self.seq_slots):
            yield start, n, slots
            start += n


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last `n` tokens of a sequence over all `L` of its tokens.

    q `[n, H, dk]`, k `[L, H, dk]`, v `[L, H, dv]` (heads already matched) ->
    `[n, H, dv]`. Query `i` sits at position `p = L - n + i` and sees keys
    `0 .. p`. Its scores row spans `attention_width(p)` keys, whatever `L` is:
    keys past `p` are masked to -inf (weight exactly 0), and keys past `L` are
    zero padding, so prefill, extend over a loaded prefix and decode all run
    the same reductions for the same position.
    """
    n, length = q.shape[0], k.shape[0]
    if not 1 <= n <= length or v.shape[0] != length:
        raise EngineError(f"causal_attend: {n} queries over {length} keys and {v.shape[0]} values")
    first = length - n
    widest = attention_width(length - 1)
    if widest > length:
        # Zeros, not uninitialized memory: a zero weight times NaN/inf garbage is NaN.
        k = torch.cat([k, k.new_zeros((widest - length, *k.shape[1:]))])
        v = torch.cat([v, v.new_zeros((widest - length, *v.shape[1:]))])
    k_heads = k.transpose(0, 1)  # [H, W, dk]
    v_heads = v.permute(1, 2, 0)  # [H, dv, W]
    outs = []
    pos = first
    while pos < length:
        width = attention_width(pos)
        stop = min(length, width)  # queries pos .. stop-1 share this block's width
        qb = q[pos - first:stop - first].transpose(0, 1)  # [H, m, dk]
        scores = rowdot(qb, k_heads[:, :width]) * scale  # [H, m, width]
        q_pos = torch.arange(pos, stop, device=q.device).unsqueeze(1)
        k_pos = torch.arange(width, device=q.device).unsqueeze(0)
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        outs.append(rowdot(probs, v_heads[..., :width]).transpose(0, 1))  # [m, H, dv]
        pos = stop
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attention_width(position: int) -> int:
    """How many keys the query at `position` reduces over (see `causal_attend`)."""
    return (position // ATTN_BLOCK + 1) * ATTN_BLOCK


def paged_attention_mha(q: torch.Tensor, pool: DevicePool, layer_id: int, batch: ForwardBatch,
                        scale: float) -> torch.Tensor:
    """GQA over the pool: q `[T, H, d]` (rotated) -> `[T, H, dv]`.

    K/V of each request are gathered from `pool` by its slot list; the query
    heads of one group share a KV head.
    """
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    group = q.shape[1] // k_buf.shape[1]
    outs = []
    for start, n, slots in batch.segments():
        k = k_buf[slots].to(q.dtype)
        v = v_buf[slots].to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        outs.append(causal_attend(q[start:start + n], k, v, scale))
    return torch.cat(outs)


def paged_attention_mla(q: torch.Tensor, pool: DevicePool, layer_id: int, batch: ForwardBatch,
                        scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA over the pool: q `[T, H, kv_lora_rank + rope]` -> `[T, H, kv_lora_rank]`.

    The pool holds one latent per token, `[compressed kv | rotated k_pe]`. With
    the K up-projection absorbed into q, every head attends over the latent
    itself (keys: the whole latent; values: its first `kv_lora_rank` columns);
    the caller applies the V up-projection to the result.
    """
    buf = pool.get_key_buffer(layer_id)
    heads = q.shape[1]
    outs = []
    for start, n, slots in batch.segments():
        latent = buf[slots].to(q.dtype)  # [L, 1, kv_lora_rank + rope]
        k = latent.expand(-1, heads, -1)
        v = latent[..., :kv_lora_rank].expand(-1, heads, -1)
        outs.append(causal_attend(q[start:start + n], k, v, scale))
    return torch.cat(outs)
