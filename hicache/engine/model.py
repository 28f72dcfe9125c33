"""The reference engine's model: a tiny decoder-only transformer with paged KV.

RMSNorm, rotary embeddings (NeoX halves), GQA attention or a simplified
absorbed MLA, SwiGLU MLP. Weights are random but deterministic (one seeded
`torch.Generator`), so two processes building the same `ModelConfig` hold the
same model and nothing is downloaded. The model exists to exercise hicache:
what it writes into the `DevicePool` must be exactly what `layout()` describes,
and KV loaded into the pool from elsewhere must be used exactly like KV it
computed itself (see `attention.py` for how the forward stays batch-invariant).

MLA here: per token, the cached latent is `[c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]`, one "head". Head `h` derives its keys as
`[W_uk[h] c_kv | k_pe]` and values as `W_uv[h] c_kv`; the paged forward never
materializes them (it absorbs W_uk into the query and applies W_uv after
attention), while `dense_logits` does, which makes it an independent check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.engine.attention import (
    EngineError,
    ForwardBatch,
    paged_attention_mha,
    paged_attention_mla,
    rowdot,
)
from hicache.errors import ConfigError, LayoutError
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool, torch_dtype

LayerHook = Callable[[int], None]

# torch runs an elementwise op on one thread below 32768 elements, and on
# vector lanes throughout when the length is a multiple of the vector step; a
# transcendental (exp in silu) can differ by an ulp between the vector and the
# scalar tail path, so `_silu_rows` keeps every call inside both limits.
_ELEMWISE_CHUNK = 16384
_VECTOR_PAD = 64
# The model computes in, and caches, its own dtype (an fp8 KV cache would need scales).
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 512
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # MHA/GQA KV heads; 1 for MLA (one shared latent)
    head_dim: int = 32  # MHA: q/k head dim; MLA: the non-rotary part of q/k per head
    v_head_dim: int = 0  # 0 means head_dim
    intermediate: int = 256
    attention: str = "mha"  # "mha" or "mla"
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    rope_theta: float = 10000.0
    max_positions: int = 4096
    rms_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.v_head_dim < 0:
            raise ConfigError("v_head_dim must be >= 0")
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.attention == "mha":
            if self.num_heads % self.num_kv_heads:
                raise ConfigError("num_heads must be a multiple of num_kv_heads")
            if self.head_dim % 2:
                raise ConfigError("head_dim must be even (rotary halves)")
            if self.kv_lora_rank or self.qk_rope_head_dim:
                raise ConfigError("an MHA model takes no kv_lora_rank / qk_rope_head_dim")
        elif self.attention == "mla":
            if self.num_kv_heads != 1:
                raise ConfigError("an MLA model caches one latent per token: num_kv_heads must be 1")
            if self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
                raise ConfigError("MLA needs kv_lora_rank > 0 and an even qk_rope_head_dim > 0")
        else:
            raise ConfigError(f"attention must be 'mha' or 'mla', got {self.attention!r}")

    @classmethod
    def tiny_mla(cls, **overrides: object) -> ModelConfig:
        """The default tiny size with MLA attention."""
        fields = dict(attention="mla", num_kv_heads=1, kv_lora_rank=64, qk_rope_head_dim=16)
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width that the softmax scale is taken over."""
        return self.head_dim + self.qk_rope_head_dim


def rope_tables(rope_dim: int, theta: float, max_positions: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One cos/sin table for all positions, indexed (an exact gather) per step."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


class TinyTransformer:
    """Inference-only; weights are plain tensors (no autograd) on `device`."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        self.scale = config.qk_head_dim ** -0.5
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def normal(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32)
            if fan_in is not None:
                w = w / fan_in ** 0.5
            return w.to(device=self.device, dtype=self.dtype)

        def norm_weight(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(device=self.device, dtype=self.dtype)

        self.embed = normal(c.vocab_size, c.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            w: dict[str, torch.Tensor] = {"attn_norm": norm_weight(c.hidden)}
            if c.is_mla:
                w["wq"] = normal(c.num_heads * c.qk_head_dim, c.hidden, fan_in=c.hidden)
                w["w_kv_a"] = normal(c.kv_lora_rank + c.qk_rope_head_dim, c.hidden, fan_in=c.hidden)
                w["kv_norm"] = norm_weight(c.kv_lora_rank)
                w["w_uk"] = normal(c.num_heads, c.kv_lora_rank, c.head_dim, fan_in=c.kv_lora_rank)
                w["w_uv"] = normal(c.num_heads, c.v_head_dim, c.kv_lora_rank, fan_in=c.kv_lora_rank)
            else:
                w["wq"] = normal(c.num_heads * c.head_dim, c.hidden, fan_in=c.hidden)
                w["wk"] = normal(c.num_kv_heads * c.head_dim, c.hidden, fan_in=c.hidden)
                w["wv"] = normal(c.num_kv_heads * c.v_head_dim, c.hidden, fan_in=c.hidden)
            w["wo"] = normal(c.hidden, c.num_heads * c.v_head_dim, fan_in=c.num_heads * c.v_head_dim)
            w["mlp_norm"] = norm_weight(c.hidden)
            w["w_gate"] = normal(c.intermediate, c.hidden, fan_in=c.hidden)
            w["w_up"] = normal(c.intermediate, c.hidden, fan_in=c.hidden)
            w["w_down"] = normal(c.hidden, c.intermediate, fan_in=c.intermediate)
            self.layers.append(w)
        self.final_norm = norm_weight(c.hidden)
        self.lm_head = normal(c.vocab_size, c.hidden, fan_in=c.hidden)
        self.rope_cos, self.rope_sin = rope_tables(c.rope_dim, c.rope_theta, c.max_positions, self.device,
                                                   self.dtype)

    def layout(self, page_size: int) -> KVLayout:
        """The geometry of what `forward` writes into a DevicePool."""
        c = self.config
        if c.is_mla:
            return KVLayout(kind="mla", num_layers=c.num_layers, page_size=page_size, dtype=c.dtype,
                            kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim)
        return KVLayout(kind="mha", num_layers=c.num_layers, page_size=page_size, dtype=c.dtype,
                        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, v_head_dim=c.v_head_dim)

    # -- paged forward ----------------------------------------------------
    def forward(self, batch: ForwardBatch, pool: DevicePool, layer_hook: LayerHook | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the new tokens of `batch`, writing their KV into `pool`.

        Per layer: compute the new tokens' K/V (MLA: latent), write them at
        `batch.out_slots`, call `layer_hook(layer_id)` (hicache's per-layer
        load wait goes there), then attend over each request's full slot list
        read back from the pool. Returns logits `[num_reqs, vocab]` of each
        request's last token, or `[num_tokens, vocab]` with `all_logits`.
        """
        if pool.layout != self.layout(pool.page_size):
            raise LayoutError(f"pool layout {pool.layout} is not this model's {self.layout(pool.page_size)}")
        if batch.max_seq_len > self.config.max_positions:
            raise EngineError(f"sequence of {batch.max_seq_len} tokens exceeds max_positions "
                              f"{self.config.max_positions}")
        cos = self.rope_cos[batch.positions]
        sin = self.rope_sin[batch.positions]
        h = self.embed[batch.input_ids]
        for layer_id, w in enumerate(self.layers):
            x = _rms_norm(h, w["attn_norm"], self.config.rms_eps)
            if self.config.is_mla:
                attn = self._mla_attention(layer_id, w, x, cos, sin, batch, pool, layer_hook)
            else:
                attn = self._mha_attention(layer_id, w, x, cos, sin, batch, pool, layer_hook)
            h = h + rowdot(attn, w["wo"])
            h = h + self._mlp(w, _rms_norm(h, w["mlp_norm"], self.config.rms_eps))
        if not all_logits:
            h = h[batch.last_index()]
        return rowdot(_rms_norm(h, self.final_norm, self.config.rms_eps), self.lm_head)

    def _mha_attention(self, layer_id: int, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, batch: ForwardBatch, pool: DevicePool,
                       layer_hook: LayerHook | None) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q = _rope(rowdot(x, w["wq"]).view(t, c.num_heads, c.head_dim), cos, sin)
        k = _rope(rowdot(x, w["wk"]).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = rowdot(x, w["wv"]).view(t, c.num_kv_heads, c.v_head_dim)
        pool.set_kv_buffer(layer_id, batch.out_slots, k, v)
        if layer_hook is not None:
            layer_hook(layer_id)
        out = paged_attention_mha(q, pool, layer_id, batch, self.scale)
        return out.reshape(t, c.num_heads * c.v_head_dim)

    def _mla_attention(self, layer_id: int, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, batch: ForwardBatch, pool: DevicePool,
                       layer_hook: LayerHook | None) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q = rowdot(x, w["wq"]).view(t, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., :c.head_dim], _rope(q[..., c.head_dim:], cos, sin)
        kv = rowdot(x, w["w_kv_a"])
        c_kv = _rms_norm(kv[:, :c.kv_lora_rank], w["kv_norm"], c.rms_eps)
        k_pe = _rope(kv[:, None, c.kv_lora_rank:], cos, sin)
        pool.set_kv_buffer(layer_id, batch.out_slots, torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1))
        # Absorb W_uk: q_nope . (W_uk[h] c) == (W_uk[h]^T q_nope) . c
        q_lat = rowdot(q_nope.transpose(0, 1), w["w_uk"]).transpose(0, 1)  # [T, H, kv_lora_rank]
        if layer_hook is not None:
            layer_hook(layer_id)
        out_lat = paged_attention_mla(torch.cat([q_lat, q_pe], dim=-1), pool, layer_id, batch,
                                      self.scale, c.kv_lora_rank)
        out = rowdot(out_lat.transpose(0, 1), w["w_uv"]).transpose(0, 1)  # [T, H, v_head_dim]
        return out.reshape(t, c.num_heads * c.v_head_dim)

    def _mlp(self, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return rowdot(_silu_rows(rowdot(x, w["w_gate"])) * rowdot(x, w["w_up"]), w["w_down"])

    # -- dense reference --------------------------------------------------
    def dense_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[T, vocab]` of one sequence computed without any pool.

        The textbook forward with BLAS matmuls and, for MLA, explicitly
        up-projected per-head K and V: the reference the paged forward is
        checked against (equal up to float rounding, not bitwise).
        """
        c = self.config
        ids = token_ids.to(device=self.device, dtype=torch.int64)
        t = ids.numel()
        if not 1 <= t <= c.max_positions:
            raise EngineError(f"dense_logits takes 1..{c.max_positions} tokens, got {t}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        future = torch.ones(t, t, dtype=torch.bool, device=self.device).triu(1)
        h = self.embed[ids]
        for w in self.layers:
            x = _rms_norm(h, w["attn_norm"], c.rms_eps)
            if c.is_mla:
                q = F.linear(x, w["wq"]).view(t, c.num_heads, c.qk_head_dim)
                q = torch.cat([q[..., :c.head_dim], _rope(q[..., c.head_dim:], cos, sin)], dim=-1)
                kv = F.linear(x, w["w_kv_a"])
                c_kv = _rms_norm(kv[:, :c.kv_lora_rank], w["kv_norm"], c.rms_eps)
                k_pe = _rope(kv[:, None, c.kv_lora_rank:], cos, sin)
                k_nope = torch.einsum("sr,hrj->shj", c_kv, w["w_uk"])
                k = torch.cat([k_nope, k_pe.expand(-1, c.num_heads, -1)], dim=-1)
                v = torch.einsum("sr,her->she", c_kv, w["w_uv"])
            else:
                group = c.num_heads // c.num_kv_heads
                q = _rope(F.linear(x, w["wq"]).view(t, c.num_heads, c.head_dim), cos, sin)
                k = _rope(F.linear(x, w["wk"]).view(t, c.num_kv_heads, c.head_dim), cos, sin)
                v = F.linear(x, w["wv"]).view(t, c.num_kv_heads, c.v_head_dim)
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q, k) * self.scale
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            attn = torch.einsum("hts,she->the", probs, v).reshape(t, -1)
            h = h + F.linear(attn, w["wo"])
            x = _rms_norm(h, w["mlp_norm"], c.rms_eps)
            h = h + F.linear(F.silu(F.linear(x, w["w_gate"])) * F.linear(x, w["w_up"]), w["w_down"])
        return F.linear(_rms_norm(h, self.final_norm, c.rms_eps), self.lm_head)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # sqrt and division are correctly rounded on every path; mean is an inner sum.
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, d]` by per-token `cos/sin [T, d/2]` (NeoX halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _silu_rows(x: torch.Tensor) -> torch.Tensor:
    """silu of `x [T, n]`, each element computed on the vector path in a
    single-threaded call, so its bits do not depend on T or the thread count."""
    width = x.shape[-1]
    pad = -width % _VECTOR_PAD
    xp = F.pad(x, (0, pad)) if pad else x.contiguous()
    rows = max(1, _ELEMWISE_CHUNK // xp.shape[-1])
    if xp.shape[0] <= rows:
        out = F.silu(xp)
    else:
        out = torch.cat([F.silu(xp[i:i + rows]) for i in range(0, xp.shape[0], rows)])
    return out[:, :width]
