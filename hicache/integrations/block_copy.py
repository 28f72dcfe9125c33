"""Copies between an engine's own per-layer KV block tensors and host arena pages.

Engines with their own KV cache (vLLM) allocate one tensor per attention layer
in the layout of their attention backend, e.g. vLLM's CPU backend
`[num_blocks, kv_heads, block_size, 2 * head_size]` (per block and head, K then
V) or its CUDA flash-attention layout `[2, num_blocks, block_size, kv_heads,
head_size]`. Whatever the layout, one dimension indexes blocks; moving it first
gives each block's bytes for that layer, which is what a host page keeps for
the layer: page = [layer 0 block bytes][layer 1 block bytes]...

The bytes of a block are kept as the backend arranges them, not converted:
a save followed by a load is a bit-exact round trip whatever the backend means
by them, and no conversion costs copy bandwidth. The price is that pages are
only shared between engines whose backends arrange blocks alike, so the
connector puts the arrangement into the namespace (see vllm/layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.errors import LayoutError
from hicache.layout import KVLayout
from hicache.tiers.arena import HostArena


def block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks (exactly one must
    have `num_blocks` entries among the first two; backends put it there)."""
    dims = [d for d in range(min(2, len(shape))) if shape[d] == num_blocks]
    if len(dims) != 1:
        raise LayoutError(f"cannot tell the block dimension of a KV tensor shaped {tuple(shape)} "
                          f"with {num_blocks} blocks")
    return dims[0]


def arrangement(t: torch.Tensor, num_blocks: int) -> str:
    """A short name for how a backend arranges a layer's blocks: the tensor's shape with
    the block count as 'B' (e.g. 'B,2,32,64'), its block dimension and dtype."""
    bd = block_dim(t.shape, num_blocks)
    dims = ["B" if d == bd else str(n) for d, n in enumerate(t.shape)]
    return f"{','.join(dims)}:{str(t.dtype).removeprefix('torch.')}"


class BlockCopier:
    """Moves whole blocks, all layers or one layer at a time, between `caches` (one tensor
    per layer, in layer order) and the pages of `arena` laid out for `layout`."""

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int, layout: KVLayout,
                 arena: HostArena) -> None:
        if len(caches) != layout.num_layers:
            raise LayoutError(f"{len(caches)} KV tensors for a layout of {layout.num_layers} layers")
        self.layout = layout
        self.num_blocks = num_blocks
        self.blocks: list[torch.Tensor] = []  # per layer: [num_blocks, ...] views (block dim first)
        for t in caches:
            v = t.movedim(block_dim(t.shape, num_blocks), 0)
            nbytes = v[0].numel() * v.element_size()
            if nbytes != layout.layer_page_bytes:
                raise LayoutError(f"a KV block holds {nbytes} bytes per layer; the layout's page needs "
                                  f"{layout.layer_page_bytes}")
            self.blocks.append(v)
        self.device = caches[0].device
        self.rebind(arena)

    def rebind(self, arena: HostArena) -> None:
        """Copy to and from this arena from now on (a restarted daemon has a new one)."""
        lpb = self.layout.layer_page_bytes
        num_slots = arena.nbytes // self.layout.page_bytes
        flat = torch.from_numpy(arena.array[: num_slots * self.layout.page_bytes])
        self.host = flat.view(num_slots, self.layout.num_layers, lpb)  # [slot, layer, bytes]
        self.arena = arena

    def _ids(self, block_ids: Sequence[int], host_pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
        h = torch.as_tensor(np.asarray(host_pages, dtype=np.int64))
        if b.shape != h.shape or b.ndim != 1:
            raise LayoutError(f"{len(block_ids)} blocks for {len(host_pages)} host pages")
        if len(b) and (int(b.min()) < 0 or int(b.max()) >= self.num_blocks):
            raise LayoutError(f"block ids must be in [0, {self.num_blocks})")
        if len(h) and (int(h.min()) < 0 or int(h.max()) >= self.host.shape[0]):
            raise LayoutError(f"host pages must be in [0, {self.host.shape[0]})")
        if not self.arena.covers(h.numpy(), self.layout.page_bytes):
            raise LayoutError("host pages lie outside the slabs mapped here")
        return b, h

    def save(self, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        """Every layer of the blocks into the host pages (one gather per layer)."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        bd = b.to(self.device)
        for layer, v in enumerate(self.blocks):
            src = v.index_select(0, bd).reshape(len(b), -1).view(torch.uint8)
            self.host[:, layer].index_copy_(0, h, src.cpu())

    def save_layer(self, layer: int, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        """One layer of the blocks into the host pages (hybrid models: each layer's group
        has its own block ids for a page)."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        src = self.blocks[layer].index_select(0, b.to(self.device)).reshape(len(b), -1).view(torch.uint8)
        self.host[:, layer].index_copy_(0, h, src.cpu())

    def load_layer(self, layer: int, block_ids: Sequence[int], host_pages: Sequence[int]) -> None:
        """One layer of the host pages into the blocks."""
        b, h = self._ids(block_ids, host_pages)
        if not len(b):
            return
        v = self.blocks[layer]
        src = self.host[:, layer].index_select(0, h).to(self.device, non_blocking=True)
        v[b.to(self.device)] = src.view(v.dtype).reshape(len(b), *v.shape[1:])
