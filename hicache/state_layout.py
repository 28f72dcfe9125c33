"""StateLayout: the geometry of a hybrid model's recurrent state, and the bytes of a checkpoint.

Hybrid models (Mamba2 hybrids, Qwen3-Next's gated delta-net) keep, besides the
KV of their attention layers, a fixed-size state per request in each
recurrent layer: one or more short convolution windows ("conv" states) and the
recurrence's own state ("temporal", the SSM state). Like SGLang's MambaPool
(seeds/003), every recurrent layer has the same shapes.

A *checkpoint* is that whole state after some number of tokens. In the host
arena and on disk it is one contiguous blob, component-major then layer:

    [conv 0: layer 0 .. L-1][conv 1: layer 0 .. L-1] ... [temporal: layer 0 .. L-1]

which is exactly how a device state pool shaped `[L, slots, *shape]` per
component lays one slot out when read component by component, so a copy is
one strided run per component.

Checkpoints only exist at multiples of `chunk_size` tokens (FLA's chunk, 64 by
default): a chunked kernel can only hand out its state at chunk boundaries.

Torch-free, like KVLayout: the daemon plans by bytes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from hicache.errors import LayoutError
from hicache.layout import DTYPE_ITEMSIZE

DEFAULT_CHUNK_SIZE = 64
STATE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class StateComponent:
    """One tensor of a checkpoint: `num_layers` copies of `shape` in `dtype`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # byte offset of layer 0 inside the checkpoint blob
    layer_bytes: int  # bytes of one layer's copy; layer l starts at offset + l * layer_bytes


@dataclass(frozen=True, slots=True)
class StateLayout:
    num_layers: int                              # recurrent layers (attention layers hold KV instead)
    conv_shapes: tuple[tuple[int, ...], ...]     # per conv state, its shape in one layer
    temporal_shape: tuple[int, ...]              # the recurrence's state in one layer
    conv_dtype: str = "float32"
    temporal_dtype: str = "float32"
    chunk_size: int = DEFAULT_CHUNK_SIZE         # checkpoints sit at multiples of this many tokens

    def __post_init__(self) -> None:
        _require_positive("num_layers", self.num_layers)
        _require_positive("chunk_size", self.chunk_size)
        convs = tuple(_shape(f"conv_shapes[{i}]", s) for i, s in enumerate(_sequence("conv_shapes",
                                                                                     self.conv_shapes)))
        object.__setattr__(self, "conv_shapes", convs)
        object.__setattr__(self, "temporal_shape", _shape("temporal_shape", self.temporal_shape))
        for name in ("conv_dtype", "temporal_dtype"):
            if getattr(self, name) not in STATE_DTYPES:
                raise LayoutError(f"{name} must be one of {STATE_DTYPES}, got {getattr(self, name)!r}")

    # -- bytes --------------------------------------------------------------
    def components(self) -> list[StateComponent]:
        """Every tensor of a checkpoint with its place in the blob, in blob order."""
        out: list[StateComponent] = []
        offset = 0
        parts = [(f"conv{i}", s, self.conv_dtype) for i, s in enumerate(self.conv_shapes)]
        parts.append(("temporal", self.temporal_shape, self.temporal_dtype))
        for name, shape, dtype in parts:
            layer_bytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
            out.append(StateComponent(name, shape, dtype, offset, layer_bytes))
            offset += layer_bytes * self.num_layers
        return out

    @property
    def layer_bytes(self) -> int:
        """Bytes of one recurrent layer's state."""
        return sum(c.layer_bytes for c in self.components())

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def aligned(self, num_tokens: int) -> int:
        """The last checkpoint position at or before `num_tokens`."""
        return num_tokens - num_tokens % self.chunk_size

    # -- identity -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "conv_shapes": [list(s) for s in self.conv_shapes],
                "temporal_shape": list(self.temporal_shape), "conv_dtype": self.conv_dtype,
                "temporal_dtype": self.temporal_dtype, "chunk_size": self.chunk_size}

    @classmethod
    def from_dict(cls, d: Any) -> StateLayout:
        if not isinstance(d, dict):
            raise LayoutError("state layout must be a map")
        known = {"num_layers", "conv_shapes", "temporal_shape", "conv_dtype", "temporal_dtype", "chunk_size"}
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown state layout fields: {sorted(unknown)}")
        missing = {"num_layers", "conv_shapes", "temporal_shape"} - set(d)
        if missing:
            raise LayoutError(f"state layout lacks {sorted(missing)}")
        for k in ("conv_dtype", "temporal_dtype"):
            if k in d and not isinstance(d[k], str):
                raise LayoutError(f"state layout field {k} must be str")
        convs = _sequence("conv_shapes", d["conv_shapes"])
        return cls(num_layers=d["num_layers"], conv_shapes=tuple(tuple(_sequence("conv shape", s)) for s in convs),
                   temporal_shape=tuple(_sequence("temporal_shape", d["temporal_shape"])),
                   conv_dtype=d.get("conv_dtype", "float32"), temporal_dtype=d.get("temporal_dtype", "float32"),
                   chunk_size=d.get("chunk_size", DEFAULT_CHUNK_SIZE))

    def fingerprint(self) -> bytes:
        """16 stable bytes naming this geometry; part of a hybrid namespace's salt."""
        canon = "|".join(f"{k}={v}" for k, v in sorted(self.to_dict().items()))
        return hashlib.blake2b(canon.encode(), digest_size=16, person=b"hicache-state").digest()


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")


def _sequence(name: str, value: object) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise LayoutError(f"{name} must be a list")
    return tuple(value)


def _shape(name: str, value: object) -> tuple[int, ...]:
    dims = _sequence(name, value)
    if not dims:
        raise LayoutError(f"{name} must have at least one dimension")
    for d in dims:
        _require_positive(f"a dimension of {name}", d)
    return dims
