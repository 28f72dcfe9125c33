"""Namespace salts and chained page keys.

Page key i of a sequence is `h_i = H(h_{i-1} || tokens_i as little-endian int32)`
with `h_{-1}` the namespace salt; digests are 16 bytes (BLAKE2b). Because each
key commits to everything before it, two sequences agree on page key i iff
they agree on every token up to the end of page i: equality is monotone along
a path, so prefix matching can binary-search keys instead of comparing tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from hicache.index import native_index
from hicache.layout import KVLayout
from hicache.state_layout import StateLayout

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
    state: StateLayout | None = None  # hybrid models: the recurrent state checkpointed beside the KV

    def salt(self) -> bytes:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hicache-ns")
        parts = [self.model, self.layout.fingerprint().hex(), str(self.tp_rank), str(self.tp_size), self.extra_key]
        if self.state is not None:  # absent: the salt of every pure-attention namespace is unchanged
            parts.append(self.state.fingerprint().hex())
        for part in parts:
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))  # length-prefixed: no ambiguity
            h.update(data)
        return h.digest()


class PackedKeys(Sequence):
    """Page keys as one packed blob, as they travel on the wire.

    Matching touches only a few keys per tree node (the first to find the child,
    the last to see the whole node matches, a binary search where it diverges),
    so keys are sliced out of the blob on demand instead of splitting all of them
    up front, which for an 8K-token prompt at page size 16 (512 keys) costs more
    than the rest of the match. Slices come back as lists of `bytes`.
    """

    __slots__ = ("blob", "_n")

    def __init__(self, blob: bytes) -> None:
        if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
            raise ValueError(f"keys must be packed {KEY_BYTES}-byte page keys")
        self.blob = blob
        self._n = len(blob) // KEY_BYTES

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= start:
                return []
            return np.frombuffer(self.blob, dtype=f"V{KEY_BYTES}")[start:stop].tolist()
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("page key index out of range")
        return self.blob[i * KEY_BYTES:(i + 1) * KEY_BYTES]

    def __iter__(self):  # type: ignore[override]
        return iter(self[0:self._n])


class KeyRun(Sequence):
    """The page keys of one radix node, packed in one bytes object: a list of 16-byte
    bytes objects costs 72 bytes a page (the object rounded to 64, the list's pointer),
    this its 16 and one object a node, which the cyclic GC never scans.

    A read-only sequence of 16-byte `bytes`: k[i] is a new bytes object, k[a:b] a
    KeyRun (a step other than 1 gives a list); `==` compares with a KeyRun or item by
    item with a list or tuple of keys; `blob` is the keys as one bytes object. The
    index's C module has the same type (native_keys.c), which `key_run` builds where it
    is loaded; this one stands in elsewhere (tests/index/test_key_run.py runs both)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes | bytearray | memoryview) -> None:
        blob = bytes(blob)
        if len(blob) % KEY_BYTES:
            raise ValueError("keys must be packed 16-byte page keys")
        self.blob = blob

    def __len__(self) -> int:
        return len(self.blob) // KEY_BYTES

    def __getitem__(self, i):  # type: ignore[override]
        n = len(self.blob) // KEY_BYTES
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return KeyRun(self.blob[start * KEY_BYTES:max(start, stop) * KEY_BYTES])
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("page key index out of range")
        return self.blob[i * KEY_BYTES:(i + 1) * KEY_BYTES]

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def index(self, key: object, *args: object) -> int:  # type: ignore[override]
        at = self._find(key)
        if at < 0:
            raise ValueError("the key is not in this run")
        return at

    def _find(self, key: object) -> int:
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            return -1
        blob, key = self.blob, bytes(key)
        at = blob.find(key)
        while at >= 0 and at % KEY_BYTES:  # a match across two keys is none
            at = blob.find(key, at + 1)
        return -1 if at < 0 else at // KEY_BYTES

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KEY_RUN_TYPES):  # (defined below: the C type too)
            return self.blob == bytes(other)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def __bytes__(self) -> bytes:
        return self.blob

    def __repr__(self) -> str:
        n = len(self)
        return f"KeyRun({n} keys, first {self.blob[:4].hex()})" if n else "KeyRun(0 keys)"


_native = native_index.load()
KeyRunType: type = KeyRun if _native is None else _native.KeyRun  # what key_run builds
KEY_RUN_TYPES = (KeyRun,) if _native is None else (KeyRun, _native.KeyRun)


def key_run(keys: object) -> KeyRun:
    """The keys packed (a list or tuple of 16-byte keys, a PackedKeys, a KeyRun or a blob)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        return KeyRunType(keys)  # copied
    if type(keys) is PackedKeys:
        return KeyRunType(keys.blob)
    if isinstance(keys, KEY_RUN_TYPES):
        return keys if type(keys) is KeyRunType else KeyRunType(bytes(keys))
    return KeyRunType(b"".join(keys))


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
