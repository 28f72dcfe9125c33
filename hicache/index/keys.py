"""Namespace salts and chained page keys.

Page key i of a sequence is `h_i = H(h_{i-1} || tokens_i as little-endian int32)`
with `h_{-1}` the namespace salt; digests are 16 bytes (BLAKE2b). Because each
key commits to everything before it, two sequences agree on page key i iff
they agree on every token up to the end of page i: equality is monotone along
a path, so prefix matching can binary-search keys instead of comparing tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NewType

import numpy as np

from hicache.layout import KVLayout

PageKey = NewType("PageKey", bytes)
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV bytes incompatible or private."""

    model: str
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1
    extra_key: str = ""  # LoRA id, tenant salt, ...

    def salt(self) -> bytes:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hicache-ns")
        for part in (self.model, self.layout.fingerprint().hex(), str(self.tp_rank),
                     str(self.tp_size), self.extra_key):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))  # length-prefixed: no ambiguity
            h.update(data)
        return h.digest()


class KeyList(list):
    """Page keys already known to be 16-byte `bytes` (split from a packed blob);
    the index skips re-checking them on the match path."""

    __slots__ = ()

    @classmethod
    def from_blob(cls, blob: bytes) -> KeyList:
        if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
            raise ValueError(f"keys must be packed {KEY_BYTES}-byte page keys")
        # numpy's fixed-size void items come back as exact `bytes`, ~6x faster than slicing
        return cls(np.frombuffer(blob, dtype=f"V{KEY_BYTES}").tolist())


def as_tokens(tokens: object) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no copy when already one)."""
    arr = np.ascontiguousarray(np.asarray(tokens), dtype="<i4")
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    return arr


def page_keys(salt: bytes, tokens: np.ndarray, page_size: int, parent: bytes | None = None) -> list[bytes]:
    """Chained keys of every *full* page of `tokens` (a trailing partial page has none).

    `parent` continues a chain: the key of the page just before `tokens[0]`.
    """
    data = as_tokens(tokens).tobytes()
    page_nbytes = page_size * 4
    n_pages = len(data) // page_nbytes
    prev = salt if parent is None else parent
    out: list[bytes] = []
    blake = hashlib.blake2b
    for i in range(n_pages):
        prev = blake(prev + data[i * page_nbytes:(i + 1) * page_nbytes], digest_size=KEY_BYTES).digest()
        out.append(prev)
    return out
