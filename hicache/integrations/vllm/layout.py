"""What a vLLM engine's KV looks like to hicache: its page layout and namespaces.

The scheduler process never sees the KV tensors, yet it matches and stores in
the same namespaces the workers copy into; so the namespace is derived from
configuration alone, on both sides, and each worker checks that its tensors
have the arrangement the namespace promises (`expected_arrangement`) before it
copies a byte. A namespace holds: the model, the page layout (layers, KV heads
per rank, head size, dtype, block size), TP rank and size, and an extra key
naming vLLM, the device type and the per-layer block arrangement, so engines
whose backends arrange blocks differently never share pages.

MLA: every TP rank holds the same latent KV, so all ranks share one namespace
(rank 0 of 1); only rank 0 stores, every rank loads.

Hybrid models (vLLM's hybrid KV cache manager, several KV cache groups): groups of
full-attention and sliding-window layers with one page shape are cached together,
a page holding every attention layer in layer order, each layer's block taken
from its own group's block table (`group_of_layer`). The namespace's extra key
names each layer's kind (window size), so only models of one grouping share.
Mamba / linear-attention state groups and groups of different shapes are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.layout import DTYPE_ITEMSIZE, KVLayout

VLLM_TESTED = "0.32.0"


class UnsupportedModel(ValueError):
    """The engine's configuration is one hicache cannot cache for (say which and why)."""


@dataclass(frozen=True, slots=True)
class EngineShape:
    model: str
    layout: KVLayout
    tp_size: int
    device_type: str
    arrangement: str  # expected per-layer tensor shape, block dim as 'B'
    # hybrid models only (empty: one KV cache group): per page layer, in layer order
    layer_names: tuple[str, ...] = ()
    group_of_layer: tuple[int, ...] = ()  # the KV cache group whose block table the layer uses
    windows: tuple[int | None, ...] = ()  # per group: sliding window in tokens, None for full attention

    @property
    def is_mla(self) -> bool:
        return self.layout.is_mla

    def namespace_rank(self, tp_rank: int) -> tuple[int, int]:
        """(tp_rank, tp_size) of the namespace rank `tp_rank` stores and loads in."""
        return (0, 1) if self.is_mla else (tp_rank, self.tp_size)

    @property
    def num_groups(self) -> int:
        return max(len(self.windows), 1)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def extra_key(self) -> str:
        key = f"vllm/{self.device_type}/{self.arrangement}"
        if self.is_hybrid:  # which layers attend to a window: pages of another grouping are not ours
            kinds = [f"w{w}" if w else "full" for w in (self.windows[g] for g in self.group_of_layer)]
            key += "/layers=" + ",".join(kinds)
        return key

    def stores(self, tp_rank: int) -> bool:
        """Whether this rank writes pages (MLA: rank 0 only; the others hold the same bytes)."""
        return tp_rank == 0 or not self.is_mla


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedModel(f"hicache does not cache KV of dtype {name} (supported: {sorted(DTYPE_ITEMSIZE)})")
    return name


def expected_arrangement(is_mla: bool, block_size: int, kv_heads: int, head_size: int, dtype: str) -> str:
    """The per-layer KV view vLLM (0.32) hands connectors: [B, H, N, C] whatever the backend's
    physical stride order (RFC #42082) -- MHA [B, heads, block, 2*head] (K and V in the
    content), MLA [B, 1, block, width]."""
    heads, content = (1, head_size) if is_mla else (kv_heads, 2 * head_size)
    return f"B,{heads},{block_size},{content}:{dtype}"


def engine_shape(vllm_config: Any, kv_cache_config: Any, model_id: str | None = None) -> EngineShape:
    """The layout and namespace inputs of an engine, from its configuration; raises
    UnsupportedModel for what hicache does not handle (Mamba groups, pipeline parallelism...)."""
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        raise UnsupportedModel("hicache's vLLM connector does not support pipeline parallelism "
                               f"(pipeline_parallel_size={par.pipeline_parallel_size}); use tensor parallelism")
    if getattr(par, "decode_context_parallel_size", 1) not in (1, None):
        raise UnsupportedModel("hicache's vLLM connector does not support decode context parallelism")
    groups = kv_cache_config.kv_cache_groups
    spec, windows = _group_specs(groups)
    if any(getattr(g.kv_cache_spec, "page_size_padded", None) for g in groups):
        raise UnsupportedModel("padded KV pages are not supported")
    block_size = int(spec.block_size)
    dtype = _dtype_name(spec.dtype)
    head_size = int(spec.head_size)
    num_layers = sum(len(g.layer_names) for g in groups)
    is_mla = type(spec).__name__ == "MLAAttentionSpec"
    if is_mla:
        hf = vllm_config.model_config.hf_text_config
        rope = int(getattr(hf, "qk_rope_head_dim", 0) or 0)
        lora = int(getattr(hf, "kv_lora_rank", 0) or 0) or head_size - rope
        if lora + rope != head_size:
            raise UnsupportedModel(f"MLA width {head_size} != kv_lora_rank {lora} + qk_rope_head_dim {rope}")
        layout = KVLayout("mla", num_layers, block_size, dtype, kv_lora_rank=lora, qk_rope_head_dim=rope)
        kv_heads = 1
    else:
        head_size_v = int(getattr(spec, "head_size_v", None) or head_size)
        if head_size_v != head_size:
            raise UnsupportedModel("K and V of different head sizes are not supported")
        kv_heads = int(spec.num_kv_heads)
        layout = KVLayout("mha", num_layers, block_size, dtype, num_kv_heads=kv_heads, head_dim=head_size)
    device_type = vllm_device_type()
    model = model_id or str(vllm_config.model_config.model)
    hybrid: dict[str, Any] = {}
    if len(groups) > 1:
        from vllm.model_executor.models.utils import extract_layer_index

        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        names = tuple(sorted(group_of, key=extract_layer_index))
        hybrid = {"layer_names": names, "group_of_layer": tuple(group_of[n] for n in names), "windows": windows}
    return EngineShape(model, layout, int(par.tensor_parallel_size), device_type,
                       expected_arrangement(is_mla, block_size, kv_heads, head_size, dtype), **hybrid)


def _group_specs(groups: Any) -> tuple[Any, tuple[int | None, ...]]:
    """The one page shape every group shares, and each group's window (None: full attention);
    raises UnsupportedModel naming the group hicache cannot cache."""
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) == 1:
        spec = groups[0].kv_cache_spec
        if kinds[0] not in ("FullAttentionSpec", "MLAAttentionSpec") or getattr(spec, "sliding_window", None):
            raise UnsupportedModel(f"hicache's vLLM connector caches full-attention and MLA layers, not {kinds[0]}")
        return spec, ()
    windows: list[int | None] = []
    first = groups[0].kv_cache_spec
    for g, (group, kind) in enumerate(zip(groups, kinds)):
        spec = group.kv_cache_spec
        where = f"KV cache group {g} ({kind}, layers {', '.join(group.layer_names[:3])}...)"
        if kind == "SlidingWindowSpec":
            windows.append(int(spec.sliding_window))
        elif kind == "FullAttentionSpec" and not getattr(spec, "sliding_window", None):
            windows.append(None)
        else:
            raise UnsupportedModel(
                f"hicache's vLLM connector caches hybrid models whose KV cache groups are full-attention or "
                f"sliding-window attention; {where} is not (Mamba / linear-attention state is not restored "
                "through vLLM yet). Run this model without the hicache connector")
        for field in ("block_size", "num_kv_heads", "head_size", "dtype"):
            if getattr(spec, field) != getattr(first, field):
                raise UnsupportedModel(f"hicache's vLLM connector needs one page shape in every KV cache group; "
                                       f"{where} has {field}={getattr(spec, field)}, group 0 has "
                                       f"{getattr(first, field)}")
        if getattr(spec, "extra_retained_tokens", 0):
            raise UnsupportedModel(f"{where}: sliding windows with retained extra tokens are not supported")
    return first, tuple(windows)


def vllm_device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)
