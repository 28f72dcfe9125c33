"""A hybrid reference model: recurrent (linear-attention) layers beside attention layers.

The shape of Qwen3-Next / Mamba2 hybrids, reduced to what hicache must get
right. Attention layers keep paged KV in a DevicePool (their own layer ids
0..A-1, like SGLang's HybridLinearKVPool); recurrent layers keep a fixed-size
state per request in a StatePool slot:

    conv:     the last K-1 inputs of a short causal convolution  [conv_dim, K-1]
    temporal: a gated linear-attention state S                    [heads, dv, dk]

Per token t of a recurrent layer (q, k, v come out of the convolution):
    S_t = g_t * S_{t-1} + v_t k_t^T        o_t = S_t q_t
with a per-head gate g_t = sigmoid(w_g . x_t) in (0, 1).

Exactness. Outputs after restoring KV + state equal recomputing the whole
sequence, bitwise, in float32 on CPU. Projections go through `rowdot` (batch-
invariant, see attention.py); the recurrence runs token by token on tensors
whose shapes do not depend on the batch or on where the run started, so every
elementwise op and every reduction (over the K conv taps, over dk) takes the
same code path for token t whether the state was computed in this call or
loaded from a checkpoint. A chunked kernel would be faster; this one is a
reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.engine.attention import EngineError, ForwardBatch, paged_attention_mha, rowdot
from hicache.engine.model import LayerHook, _rms_norm, _rope, _silu_rows, rope_tables
from hicache.errors import ConfigError, LayoutError
from hicache.layout import KVLayout
from hicache.state_layout import DEFAULT_CHUNK_SIZE, StateLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.device.state_pool import StatePool

LAYER_TYPES = ("attention", "recurrent")


@dataclass(frozen=True, slots=True)
class HybridConfig:
    vocab_size: int = 512
    hidden: int = 64
    layer_types: tuple[str, ...] = ("recurrent", "attention", "recurrent", "attention")
    # attention layers (GQA)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    # recurrent layers
    lin_heads: int = 2
    lin_key_dim: int = 8
    lin_value_dim: int = 16
    conv_kernel: int = 4
    intermediate: int = 128
    rope_theta: float = 10000.0
    max_positions: int = 4096
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "num_heads", "num_kv_heads", "head_dim", "lin_heads",
                     "lin_key_dim", "lin_value_dim", "intermediate", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ConfigError("conv_kernel must be an int >= 2")
        types = tuple(self.layer_types)
        if any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"layer types must be among {LAYER_TYPES}, got {types}")
        if "attention" not in types or "recurrent" not in types:
            raise ConfigError("a hybrid model needs at least one attention and one recurrent layer")
        object.__setattr__(self, "layer_types", types)
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ConfigError("num_heads must be a multiple of num_kv_heads, head_dim even")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every recurrent head."""
        return self.lin_heads * (2 * self.lin_key_dim + self.lin_value_dim)


class HybridModel:
    """Inference-only, float32, deterministic random weights (no download)."""

    def __init__(self, config: HybridConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)

        def normal(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32)
            return (w / fan_in ** 0.5 if fan_in else w).to(self.device)

        def norm_weight(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(self.device)

        self.attention_ids: list[int] = []  # global layer id -> position in these lists = pool layer id
        self.recurrent_ids: list[int] = []
        self.embed = normal(c.vocab_size, c.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        for lid, kind in enumerate(c.layer_types):
            w = {"norm": norm_weight(c.hidden)}
            if kind == "attention":
                self.attention_ids.append(lid)
                w["wq"] = normal(c.num_heads * c.head_dim, c.hidden, fan_in=c.hidden)
                w["wk"] = normal(c.num_kv_heads * c.head_dim, c.hidden, fan_in=c.hidden)
                w["wv"] = normal(c.num_kv_heads * c.head_dim, c.hidden, fan_in=c.hidden)
                w["wo"] = normal(c.hidden, c.num_heads * c.head_dim, fan_in=c.num_heads * c.head_dim)
            else:
                self.recurrent_ids.append(lid)
                w["w_qkv"] = normal(c.conv_dim, c.hidden, fan_in=c.hidden)
                w["conv"] = normal(c.conv_dim, c.conv_kernel, fan_in=c.conv_kernel)
                w["w_gate"] = normal(c.lin_heads, c.hidden, fan_in=c.hidden)
                w["gate_bias"] = torch.full((c.lin_heads,), 2.0, device=self.device)  # slow decay
                w["wo"] = normal(c.hidden, c.lin_heads * c.lin_value_dim, fan_in=c.lin_heads * c.lin_value_dim)
            w["mlp_norm"] = norm_weight(c.hidden)
            w["w_gate_mlp"] = normal(c.intermediate, c.hidden, fan_in=c.hidden)
            w["w_up"] = normal(c.intermediate, c.hidden, fan_in=c.hidden)
            w["w_down"] = normal(c.hidden, c.intermediate, fan_in=c.intermediate)
            self.layers.append(w)
        self.final_norm = norm_weight(c.hidden)
        self.lm_head = normal(c.vocab_size, c.hidden, fan_in=c.hidden)
        self.rope_cos, self.rope_sin = rope_tables(c.head_dim, c.rope_theta, c.max_positions, self.device,
                                                   torch.float32)

    # -- geometry ------------------------------------------------------------
    def kv_layout(self, page_size: int) -> KVLayout:
        """What the attention layers write into a DevicePool."""
        c = self.config
        return KVLayout(kind="mha", num_layers=len(self.attention_ids), page_size=page_size, dtype="float32",
                        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)

    def state_layout(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> StateLayout:
        """What the recurrent layers keep in a StatePool slot."""
        c = self.config
        return StateLayout(num_layers=len(self.recurrent_ids), conv_shapes=((c.conv_dim, c.conv_kernel - 1),),
                           temporal_shape=(c.lin_heads, c.lin_value_dim, c.lin_key_dim), chunk_size=chunk_size)

    # -- forward -------------------------------------------------------------
    def forward(self, batch: ForwardBatch, pool: DevicePool, states: StatePool, state_slots: Sequence[int], *,
                snapshots: Sequence[dict[int, int]] | None = None, layer_hook: LayerHook | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the new tokens of `batch`: attention KV goes into `pool`, and request i's
        recurrent state in slot `state_slots[i]` (holding the state after its prefix:
        zeros for none, a restored checkpoint otherwise) advances to the end of its
        sequence, in place. `snapshots[i]` maps positions (numbers of tokens, inside
        this step) to spare slots that receive the state there: the checkpoints
        hicache can store. `layer_hook(a)` runs before attention layer `a` reads the
        pool. Returns the logits of each request's last token (or of every token)."""
        self._check(batch, pool, states, state_slots, snapshots)
        snaps = snapshots if snapshots is not None else [{}] * batch.num_reqs
        c = self.config
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        h = self.embed[batch.input_ids]
        for lid, w in enumerate(self.layers):
            x = _rms_norm(h, w["norm"], c.rms_eps)
            if c.layer_types[lid] == "attention":
                mixed = self._attention(self.attention_ids.index(lid), w, x, cos, sin, batch, pool, layer_hook)
            else:
                mixed = self._recurrent(self.recurrent_ids.index(lid), w, x, batch, states, state_slots, snaps)
            h = h + rowdot(mixed, w["wo"])
            y = _rms_norm(h, w["mlp_norm"], c.rms_eps)
            h = h + rowdot(_silu_rows(rowdot(y, w["w_gate_mlp"])) * rowdot(y, w["w_up"]), w["w_down"])
        if not all_logits:
            h = h[batch.last_index()]
        return rowdot(_rms_norm(h, self.final_norm, c.rms_eps), self.lm_head)

    def _attention(self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: DevicePool,
                   layer_hook: LayerHook | None) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q = _rope(rowdot(x, w["wq"]).view(t, c.num_heads, c.head_dim), cos, sin)
        k = _rope(rowdot(x, w["wk"]).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = rowdot(x, w["wv"]).view(t, c.num_kv_heads, c.head_dim)
        pool.set_kv_buffer(layer, batch.out_slots, k, v)
        if layer_hook is not None:
            layer_hook(layer)
        return paged_attention_mha(q, pool, layer, batch, c.head_dim ** -0.5).reshape(t, -1)

    def _recurrent(self, layer: int, w: dict[str, torch.Tensor], x: torch.Tensor, batch: ForwardBatch,
                   states: StatePool, state_slots: Sequence[int], snaps: Sequence[dict[int, int]]) -> torch.Tensor:
        c = self.config
        hk, dk, dv = c.lin_heads, c.lin_key_dim, c.lin_value_dim
        scale = dk ** -0.5
        proj = rowdot(x, w["w_qkv"])  # [T, conv_dim]
        gate_in = rowdot(x, w["w_gate"]) + w["gate_bias"]  # [T, heads]: an add is exact elementwise
        conv_w = w["conv"]
        conv_buf, s_buf = states.conv[0], states.temporal
        rows: list[torch.Tensor] = []
        for (start, n, slots), slot, snap in zip(batch.segments(), state_slots, snaps):
            first = slots.numel() - n  # tokens before this step: the state's position
            window = conv_buf[layer, slot].clone()  # [conv_dim, K-1]
            s = s_buf[layer, slot].clone()  # [heads, dv, dk]
            for i in range(n):
                full = torch.cat([window, proj[start + i].unsqueeze(1)], dim=1)  # [conv_dim, K]
                u = F.silu((full * conv_w).sum(-1))  # a K-term sum per channel, fixed order
                window = full[:, 1:]
                q = u[:hk * dk].view(hk, dk) * scale
                k = u[hk * dk:2 * hk * dk].view(hk, dk)
                v = u[2 * hk * dk:].view(hk, dv)
                g = torch.sigmoid(gate_in[start + i])  # [heads]
                s = s * g[:, None, None] + v[:, :, None] * k[:, None, :]
                rows.append((s * q[:, None, :]).sum(-1).reshape(-1))  # o = S q, a dk-term sum
                dst = snap.get(first + i + 1)
                if dst is not None:
                    conv_buf[layer, dst] = window
                    s_buf[layer, dst] = s
            conv_buf[layer, slot] = window
            s_buf[layer, slot] = s
        return torch.stack(rows)

    def _check(self, batch: ForwardBatch, pool: DevicePool, states: StatePool, state_slots: Sequence[int],
               snapshots: Sequence[dict[int, int]] | None) -> None:
        if pool.layout != self.kv_layout(pool.page_size):
            raise LayoutError(f"pool layout {pool.layout} is not this model's {self.kv_layout(pool.page_size)}")
        want = self.state_layout(states.layout.chunk_size)
        if states.layout != want:
            raise LayoutError(f"state pool layout {states.layout} is not this model's {want}")
        if batch.max_seq_len > self.config.max_positions:
            raise EngineError(f"sequence of {batch.max_seq_len} tokens exceeds max_positions")
        if len(state_slots) != batch.num_reqs or len(set(state_slots)) != len(state_slots):
            raise EngineError("one distinct state slot per request")
        for s in state_slots:
            if type(s) is not int or not 1 <= s <= states.num_slots:
                raise EngineError(f"state slot {s!r} is not in 1..{states.num_slots}")
        if snapshots is None:
            return
        if len(snapshots) != batch.num_reqs:
            raise EngineError("one snapshot map per request")
        used = set(state_slots)
        for snap, (_, n, slots) in zip(snapshots, batch.segments()):
            first, end = slots.numel() - n, slots.numel()
            for pos, dst in snap.items():
                if not first < pos <= end:
                    raise EngineError(f"snapshot position {pos} is outside this step's tokens ({first}, {end}]")
                if type(dst) is not int or not 1 <= dst <= states.num_slots or dst in used:
                    raise EngineError(f"snapshot slot {dst!r} is not a spare slot")
                used.add(dst)
