"""StatePool: an engine's device slots for hybrid-model recurrent state (SGLang's MambaPool).

Per component of the StateLayout (the conv states, then the temporal state) one
tensor shaped `[num_layers, num_slots + 1, *shape]`; slot 0 is padding, usable
slots are 1..num_slots. A running request owns one slot and updates it in
place token by token; a checkpoint is a copy of a slot at a chunk boundary.
Requests never share a slot: reusing a cached checkpoint means copying it into
a private slot first (`fork_from`, copy on write), because the next token
overwrites the state.

Host transfers use the checkpoint blob of StateLayout (component-major, then
layer), the byte layout of a host state slot and of a checkpoint on disk.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.errors import HiCacheError
from hicache.state_layout import StateLayout
from hicache.tiers.device.pool import torch_dtype


class StatePoolError(HiCacheError, ValueError):
    """A bad slot id or buffer was passed to the state pool; nothing changed."""


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int, device: str | torch.device = "cpu") -> None:
        if type(num_slots) is not int or num_slots <= 0:
            raise StatePoolError(f"num_slots must be a positive int, got {num_slots!r}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.components = layout.components()
        self.buffers: list[torch.Tensor] = [
            torch.zeros((layout.num_layers, num_slots + 1, *c.shape), dtype=torch_dtype(c.dtype), device=self.device)
            for c in self.components]
        self._free = list(range(num_slots, 0, -1))  # pop() hands out the lowest first

    @property
    def conv(self) -> list[torch.Tensor]:
        return self.buffers[:-1]

    @property
    def temporal(self) -> torch.Tensor:
        return self.buffers[-1]

    # -- slots -------------------------------------------------------------
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        """n zeroed slots, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for buf in self.buffers:
            buf[:, idx] = 0
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self._check(s)
        if len(set(slots)) != len(slots) or set(slots) & set(self._free):
            raise StatePoolError(f"slots {slots} are freed twice")
        self._free.extend(slots)

    def copy(self, src: int, dst: int) -> None:
        self._check(src)
        self._check(dst)
        for buf in self.buffers:
            buf[:, dst] = buf[:, src]

    def copy_layer(self, layer: int, src: int, dst: int) -> None:
        for buf in self.buffers:
            buf[layer, dst] = buf[layer, src]

    def fork_from(self, src: int) -> int | None:
        """A new private slot holding a copy of `src`, or None when no slot is free."""
        self._check(src)
        got = self.alloc(1)
        if got is None:
            return None
        self.copy(src, got[0])
        return got[0]

    # -- host transfers ----------------------------------------------------
    def write_to(self, slot: int, out: np.ndarray) -> None:
        """Copy `slot` into `out` (uint8, checkpoint_bytes long: a host state slot)."""
        self._check(slot)
        for i, view in enumerate(self._views(out)):
            view.copy_(self.buffers[i][:, slot])

    def read_from(self, data: np.ndarray, slot: int) -> None:
        """Copy a checkpoint blob (uint8, checkpoint_bytes long) into `slot`."""
        self._check(slot)
        for i, view in enumerate(self._views(data)):
            self.buffers[i][:, slot] = view.to(self.device)

    def _views(self, blob: np.ndarray) -> list[torch.Tensor]:
        if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1:
            raise StatePoolError("a checkpoint buffer must be a 1-D uint8 numpy array")
        if len(blob) != self.layout.checkpoint_bytes:
            raise StatePoolError(f"a checkpoint has {self.layout.checkpoint_bytes} bytes, the buffer {len(blob)}")
        raw = torch.from_numpy(blob)
        L = self.layout.num_layers
        return [raw[c.offset:c.offset + L * c.layer_bytes].view(torch_dtype(c.dtype)).view(L, *c.shape)
                for c in self.components]

    def _check(self, slot: object) -> None:
        if type(slot) is not int or not 1 <= slot <= self.num_slots:
            raise StatePoolError(f"state slots are ints in 1..{self.num_slots}, got {slot!r}")
