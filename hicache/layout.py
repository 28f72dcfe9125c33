"""KVLayout: the geometry of one model's KV cache, and the byte layout of a page.

A *page* is `page_size` consecutive tokens. In the host arena and on disk a
page is one contiguous blob, page-first:

    page = [layer 0: K tokens | V tokens][layer 1: K | V] ... [layer L-1: K | V]

with K as `[page_size, num_kv_heads, head_dim]` and V as
`[page_size, num_kv_heads, v_head_dim]`. An MLA model keeps one latent buffer
per layer (`kv_lora_rank + qk_rope_head_dim` wide, one "head") and no V.
A per-layer load therefore reads one contiguous `layer_page_bytes` run per
page, and the device pool's page is contiguous too, so copies move long runs.

This module does not import torch: the daemon plans by bytes and never needs it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from hicache.errors import LayoutError

# Bytes per element of every KV dtype hicache accepts (torch dtype names).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
KINDS = ("mha", "mla")


@dataclass(frozen=True, slots=True)
class KVLayout:
    kind: str  # "mha" or "mla"
    num_layers: int
    page_size: int
    dtype: str = "float16"
    # MHA / GQA
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0  # 0 means "same as head_dim"
    # MLA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LayoutError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        for name in ("num_layers", "page_size"):
            _require_positive(name, getattr(self, name))
        if self.kind == "mha":
            _require_positive("num_kv_heads", self.num_kv_heads)
            _require_positive("head_dim", self.head_dim)
            if self.v_head_dim < 0:
                raise LayoutError("v_head_dim must be >= 0")
            if self.v_head_dim == 0:
                object.__setattr__(self, "v_head_dim", self.head_dim)
            if self.kv_lora_rank or self.qk_rope_head_dim:
                raise LayoutError("an MHA layout takes no kv_lora_rank / qk_rope_head_dim")
        else:
            _require_positive("kv_lora_rank", self.kv_lora_rank)
            if self.qk_rope_head_dim < 0:
                raise LayoutError("qk_rope_head_dim must be >= 0")
            if self.num_kv_heads or self.head_dim or self.v_head_dim:
                raise LayoutError("an MLA layout takes no num_kv_heads / head_dim / v_head_dim")

    # -- shapes per token -------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def k_heads(self) -> int:
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def k_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of V per head; 0 for MLA (the latent buffer holds both)."""
        return 0 if self.is_mla else self.v_head_dim

    @property
    def has_v(self) -> bool:
        return not self.is_mla

    # -- bytes ------------------------------------------------------------
    @property
    def k_token_bytes(self) -> int:
        return self.k_heads * self.k_dim * self.itemsize

    @property
    def v_token_bytes(self) -> int:
        return self.k_heads * self.v_dim * self.itemsize

    @property
    def k_page_bytes(self) -> int:
        return self.page_size * self.k_token_bytes

    @property
    def v_page_bytes(self) -> int:
        return self.page_size * self.v_token_bytes

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer of one page (K then V) inside a host page."""
        return self.k_page_bytes + self.v_page_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_page_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    # -- identity ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        if not isinstance(d, dict):
            raise LayoutError("layout must be a map")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown layout fields: {sorted(unknown)}")
        for k, v in d.items():
            want = str if k in ("kind", "dtype") else int
            if not isinstance(v, want) or isinstance(v, bool):
                raise LayoutError(f"layout field {k} must be {want.__name__}")
        return cls(**d)

    def fingerprint(self) -> bytes:
        """16 stable bytes naming this geometry; part of every namespace salt."""
        canon = "|".join(f"{k}={v}" for k, v in sorted(self.to_dict().items()))
        return hashlib.blake2b(canon.encode(), digest_size=16, person=b"hicache-layout").digest()


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
