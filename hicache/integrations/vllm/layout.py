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

    @property
    def is_mla(self) -> bool:
        return self.layout.is_mla

    def namespace_rank(self, tp_rank: int) -> tuple[int, int]:
        """(tp_rank, tp_size) of the namespace rank `tp_rank` stores and loads in."""
        return (0, 1) if self.is_mla else (tp_rank, self.tp_size)

    def extra_key(self) -> str:
        return f"vllm/{self.device_type}/{self.arrangement}"

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
    UnsupportedModel for what hicache does not handle (hybrid models, pipeline parallelism...)."""
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        raise UnsupportedModel("hicache's vLLM connector does not support pipeline parallelism "
                               f"(pipeline_parallel_size={par.pipeline_parallel_size}); use tensor parallelism")
    if getattr(par, "decode_context_parallel_size", 1) not in (1, None):
        raise UnsupportedModel("hicache's vLLM connector does not support decode context parallelism")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModel(f"hicache's vLLM connector caches models with one KV cache group (full attention "
                               f"in every layer); this one has {len(groups)} (hybrid, sliding-window or Mamba layers)")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in ("FullAttentionSpec", "MLAAttentionSpec") or getattr(spec, "sliding_window", None):
        raise UnsupportedModel(f"hicache's vLLM connector caches full-attention and MLA layers, not {kind}")
    if getattr(spec, "page_size_padded", None):
        raise UnsupportedModel("padded KV pages are not supported")
    block_size = int(spec.block_size)
    dtype = _dtype_name(spec.dtype)
    head_size = int(spec.head_size)
    num_layers = len(groups[0].layer_names)
    is_mla = kind == "MLAAttentionSpec"
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
    return EngineShape(model, layout, int(par.tensor_parallel_size), device_type,
                       expected_arrangement(is_mla, block_size, kv_heads, head_size, dtype))


def vllm_device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)
