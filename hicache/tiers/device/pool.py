"""The device tier: the engine's KV pool (SGLang's MHATokenToKVPool / MLATokenToKVPool).

Per layer, a K buffer `[num_slots + page_size, k_heads, k_dim]` and (MHA only)
a V buffer `[num_slots + page_size, k_heads, v_dim]`. Page 0 (slots
`0 .. page_size-1`) is padding: writes to slot 0 by padded batches land there
harmlessly, and allocators hand out pages `1 .. num_pages`. The same class
serves CPU tensors (tests, CI) and CUDA tensors (engines).
"""

from __future__ import annotations

import torch

from hicache.errors import LayoutError
from hicache.layout import KVLayout


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"this torch build has no dtype {name!r}")
    return dt


class DevicePool:
    def __init__(self, layout: KVLayout, num_slots: int, device: str | torch.device = "cpu") -> None:
        if num_slots <= 0 or num_slots % layout.page_size:
            raise LayoutError(f"num_slots must be a positive multiple of page_size={layout.page_size}")
        self.layout = layout
        self.num_slots = num_slots
        self.page_size = layout.page_size
        self.num_pages = num_slots // layout.page_size
        self.device = torch.device(device)
        self.dtype = torch_dtype(layout.dtype)
        rows = num_slots + layout.page_size
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros((rows, layout.k_heads, layout.k_dim), dtype=self.dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            torch.zeros((rows, layout.k_heads, layout.v_dim), dtype=self.dtype, device=self.device)
            for _ in range(layout.num_layers)
        ] if layout.has_v else []

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V for MHA; for MLA the latent buffer (K and V share it)."""
        return self.v_buffers[layer_id] if self.layout.has_v else self.k_buffers[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None = None) -> None:
        """Write K (and V) for token slots `loc` of one layer."""
        self.k_buffers[layer_id][loc] = cache_k.to(self.dtype)
        if self.layout.has_v:
            if cache_v is None:
                raise LayoutError("an MHA pool needs cache_v")
            self.v_buffers[layer_id][loc] = cache_v.to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffers + self.v_buffers)
