"""On-disk format of the LMDB disk tier (hicache/tiers/disk/tier.py): records and
checksums (the protocol for opening the environment's directory is env.py's).

Three named databases live in one LMDB environment:

- ``pages``: 16-byte page key -> the page bytes, unframed. Keeping the value
  unframed lets the writer hand the caller's buffer (a host-arena view) to
  ``txn.put`` as is: a header in front would cost one extra copy of every page
  (~15% of the write path at LMDB's ~7 GB/s). The page's header lives in
  ``meta`` instead, written in the same transaction, so the two never disagree
  except through corruption, which the checksum catches.
- ``meta``: page key -> ``MetaRecord`` (struct, never pickle): parent key,
  namespace salt, size, checksum, last access, then the page's tokens as
  little-endian int32.
- ``info``: ``format`` -> magic, format version, creation time; ``totals`` ->
  used bytes and number of pages, rewritten in every write transaction so the
  byte budget survives restarts without a scan.

Beside LMDB's ``data.mdb``/``lock.mdb`` the directory holds ``hicache-disk.lock``
(an ``flock`` held by the one owner process) and ``hicache-disk.state`` (JSON:
closed cleanly or not, durability mode, boot id; see DiskTier's docstring and
env.py).

Checksums. Every new record carries XXH3-64 (the ``xxhash`` library) of the
page: ~60 GB/s for 16 KiB-4 MiB here, a quarter of a copy's cost, and, unlike
a plain sum, it notices swapped, shifted or duplicated words. The meta record
keeps its algorithm id (``algo``) and two u64 slots (XXH3 uses the first; the
second is 0), so records written by older builds stay readable: ``sum64``
(id 1, a Fletcher-style numpy sum over 4 KiB blocks that misses a swap of two
words inside a block) and ``crc32`` (id 2) are still verified on read, never
written. Any other id makes the record malformed (a miss, the entry dropped).
"""

from __future__ import annotations

import functools
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np
import xxhash

from hicache.errors import DiskTierDamaged

KEY_BYTES = 16
FORMAT_MAGIC = b"hicache-disk-v1\0"  # 16 bytes
FORMAT_VERSION = 1

DB_PAGES = b"pages"
DB_META = b"meta"
DB_INFO = b"info"
INFO_FORMAT_KEY = b"format"
INFO_TOTALS_KEY = b"totals"

LOCK_FILE = "hicache-disk.lock"  # flock: one owner process
STATE_FILE = "hicache-disk.state"  # JSON: closed cleanly? under which boot id?
ENV_FILES = ("data.mdb", "lock.mdb", STATE_FILE)  # what reset=True deletes

# durability mode -> (sync, metasync); writemap is always on (see DiskTier)
SYNC_FLAGS = {"none": (False, False), "batch": (True, False), "sync": (True, True)}

CHECKSUM_SUM64 = 1  # read only: records of older builds
CHECKSUM_CRC32 = 2  # read only
CHECKSUM_XXH3 = 3  # XXH3-64; every new record
_ALGO_IDS = frozenset((CHECKSUM_SUM64, CHECKSUM_CRC32, CHECKSUM_XXH3))

_INFO = struct.Struct("<16sIId")  # magic, version, reserved, created (unix s)
_TOTALS = struct.Struct("<QQ")  # used_bytes, num_pages
# parent, salt, size, checksum a, checksum b, last_access, n_tokens, algo, flags
META_HEADER = struct.Struct("<16s16sQQQdIHH")
META_HEADER_BYTES = META_HEADER.size  # 72; the int32 tokens follow, 4-byte aligned
_READ_FIELDS = struct.Struct("<16x16sQQQ8xIH")  # salt, size, checksum a, b, n_tokens, algo
_FLAG_HAS_PARENT = 1
_OFF_LAST_ACCESS = 16 + 16 + 8 + 8 + 8
_NO_PARENT = bytes(KEY_BYTES)
_xxh3 = xxh3_64 = xxhash.xxh3_64_intdigest  # over any C-contiguous buffer, no copy

_BLOCK_WORDS = 512  # sum64's 4 KiB blocks
GIL_FREE_COPY_BYTES = 128 << 10  # see copy_into
HASH_DST_BYTES = 1 << 20  # see copy_verified: half of L2 here


# LMDB's layout on 4 KiB pages (mdb.c): a 16-byte page header, 8-byte node headers, and a
# value that makes its leaf node larger than NODE_MAX goes to overflow pages of its own.
LMDB_PAGE_HEADER = 16
_LMDB_NODE = 8
_NODE_MAX = ((4096 - LMDB_PAGE_HEADER) // 2 & -2) - 2


def check_key(name: str, value: object) -> bytes:
    """`value` if it is a key (16 bytes), else ValueError naming it."""
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {type(value).__name__} "
                         f"of length {len(value) if isinstance(value, (bytes, bytearray)) else '?'}")
    return value


def _value_footprint(value_bytes: int, psize: int) -> int:
    node = _LMDB_NODE + KEY_BYTES + value_bytes
    if node <= _NODE_MAX:
        return 2 * (node + 2)  # in a leaf, charged at half fill (a split leaves leaves half full)
    return -(-(value_bytes + LMDB_PAGE_HEADER) // psize) * psize + 2 * (_LMDB_NODE + KEY_BYTES + 8 + 2)


@functools.lru_cache(maxsize=1024)  # the writer asks for every page, and pages come in a few sizes
def footprint(page_bytes: int, num_tokens: int, psize: int = 4096) -> int:
    """A bound on the map bytes one stored page takes: the page and its meta record,
    each in a leaf at half fill or in whole overflow pages (a 64 KiB page takes 17
    pages, and a 512-token meta record one more), with their keys' leaf nodes."""
    return (_value_footprint(page_bytes, psize)
            + _value_footprint(META_HEADER_BYTES + 4 * num_tokens, psize))


@dataclass(slots=True)
class DiskRecord:
    """One page's metadata, as yielded by ``DiskTier.iter_meta`` for the index rebuild."""

    key: bytes
    parent_key: bytes | None  # None: first page of a sequence (its chain starts at the salt)
    salt: bytes
    tokens: np.ndarray  # int32, a read-only view over the record bytes
    size: int
    last_access: float  # unix seconds, coarse (see DiskTier.touch)


@dataclass(slots=True)
class MetaHeader:
    parent_key: bytes | None
    salt: bytes
    size: int
    checksum: tuple[int, int]
    last_access: float
    algo: int


def checksum(data: object) -> tuple[int, int]:
    """The checksum of a new record: XXH3-64 of any C-contiguous buffer (no copy)."""
    return _xxh3(data), 0


def verify(algo: int, data: object, want: tuple[int, int]) -> bool:
    """Whether `data` (a C-contiguous buffer) has checksum `want` under algorithm `algo`."""
    if algo == CHECKSUM_XXH3:
        return (_xxh3(data), 0) == want
    if algo == CHECKSUM_CRC32:
        return (zlib.crc32(data), 0) == want
    if algo == CHECKSUM_SUM64:
        return _sum64(np.frombuffer(data, dtype=np.uint8)) == want
    return False


def copy_verified(algo: int, src: object, dst: memoryview, want: tuple[int, int]) -> bool:
    """Copy `src` into `dst` (flat bytes of the same size) and say whether the bytes
    copied have checksum `want`. Up to HASH_DST_BYTES the copy goes first and
    XXH3 reads the destination from L2 right after; above, XXH3 reads `src`
    first and the copy finds it in L3 (measured with the disk tier's gets,
    16 KiB-4 MiB; copying 256 KiB chunks and hashing each one right after, with
    a streaming XXH3, did no better for 2-4 MiB). `src` must not change
    meanwhile (an LMDB view inside a read transaction)."""
    if algo == CHECKSUM_XXH3:
        if dst.nbytes > HASH_DST_BYTES:
            ok = _xxh3(src) == want[0] and want[1] == 0
            copy_into(dst, src)
            return ok
        copy_into(dst, src)
        return _xxh3(dst) == want[0] and want[1] == 0
    copy_into(dst, src)
    return verify(algo, dst, want)


def copy_into(dst: memoryview, src: object) -> None:
    """dst[:] = src. Big pages go through numpy, which drops the GIL for the
    memcpy (the event loop runs meanwhile); small ones through the memoryview,
    ~1.5 us cheaper per call."""
    if dst.nbytes >= GIL_FREE_COPY_BYTES:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def _sum64(data: np.ndarray) -> tuple[int, int]:
    """The old default: ``a`` = sum of all 64-bit words, ``b`` = sum of (block
    index + 1) * block sum over 4 KiB blocks, both mod 2**64; the tail block is
    zero-padded."""
    n = data.size
    n_full = n >> 12
    head = np.add.reduce(data[:n_full << 12].view("<u8").reshape(n_full, _BLOCK_WORDS), axis=1)
    tail = data[n_full << 12:]
    if tail.size:
        pad = np.zeros(-tail.size % 8, dtype=np.uint8)
        head = np.concatenate([head, np.add.reduce(np.concatenate([tail, pad]).view("<u8"), keepdims=True)])
    weights = np.stack([np.ones(head.size, dtype=np.uint64), np.arange(1, 1 + head.size, dtype=np.uint64)])
    a, b = (weights @ head).tolist()  # uint64 arithmetic wraps modulo 2**64, no warnings
    return a, b


def pack_meta(parent_key: bytes | None, salt: bytes, size: int, digest: tuple[int, int],
              last_access: float, algo: int, tokens: bytes) -> bytes:
    flags = _FLAG_HAS_PARENT if parent_key is not None else 0
    header = META_HEADER.pack(parent_key or _NO_PARENT, salt, size, digest[0], digest[1],
                              last_access, len(tokens) // 4, algo, flags)
    return header + tokens


def unpack_meta_header(buf: bytes | memoryview) -> MetaHeader | None:
    """The fixed part of a meta record, or None if the record is malformed."""
    if len(buf) < META_HEADER_BYTES:
        return None
    parent, salt, size, a, b, last, n_tokens, algo, flags = META_HEADER.unpack_from(buf)
    if len(buf) != META_HEADER_BYTES + 4 * n_tokens or algo not in _ALGO_IDS:
        return None
    return MetaHeader(parent if flags & _FLAG_HAS_PARENT else None, salt, size, (a, b), last, algo)


def read_fields(buf: memoryview, _unpack=_READ_FIELDS.unpack_from) -> tuple | None:
    """What a read needs from a meta record, in one unpack: (salt, size,
    checksum, algo), or None if the record is malformed."""
    if len(buf) < META_HEADER_BYTES:
        return None
    salt, size, a, b, n_tokens, algo = _unpack(buf)
    if len(buf) != META_HEADER_BYTES + 4 * n_tokens or algo not in _ALGO_IDS:
        return None
    return salt, size, (a, b), algo


def unpack_record(key: bytes, value: bytes, _unpack=META_HEADER.unpack_from,
                  _frombuffer=np.frombuffer) -> DiskRecord | None:
    """A full ``DiskRecord`` from a meta key/value pair (both bytes), or None if malformed."""
    try:
        parent, salt, size, _a, _b, last, n_tokens, _algo, flags = _unpack(value)
    except struct.error:
        return None
    if len(value) != META_HEADER_BYTES + 4 * n_tokens or len(key) != KEY_BYTES:
        return None
    tokens = _frombuffer(value, "<i4", -1, META_HEADER_BYTES)
    return DiskRecord(key, parent if flags & _FLAG_HAS_PARENT else None, salt, tokens, size, last)


def with_last_access(record: bytes, last_access: float) -> bytes:
    out = bytearray(record)
    struct.pack_into("<d", out, _OFF_LAST_ACCESS, last_access)
    return bytes(out)


def pack_info() -> bytes:
    return _INFO.pack(FORMAT_MAGIC, FORMAT_VERSION, 0, time.time())


def check_info(value: bytes | None, path: str) -> float:
    """Validate the ``info/format`` record; return the creation time."""
    if value is None:
        raise DiskTierDamaged(f"{path}: LMDB environment has no hicache format record (foreign or damaged)")
    if len(value) != _INFO.size:
        raise DiskTierDamaged(f"{path}: malformed hicache format record ({len(value)} bytes)")
    magic, version, _reserved, created = _INFO.unpack(value)
    if magic != FORMAT_MAGIC:
        raise DiskTierDamaged(f"{path}: not a hicache disk tier (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise DiskTierDamaged(f"{path}: disk tier format version {version}, this build reads "
                            f"{FORMAT_VERSION}; open with reset=True to discard it")
    return created


def pack_totals(used_bytes: int, num_pages: int) -> bytes:
    return _TOTALS.pack(used_bytes, num_pages)


def unpack_totals(value: bytes | None, path: str) -> tuple[int, int]:
    if value is None or len(value) != _TOTALS.size:
        raise DiskTierDamaged(f"{path}: missing or malformed totals record (damaged environment)")
    return _TOTALS.unpack(value)
