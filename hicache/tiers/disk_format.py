"""On-disk format of the LMDB disk tier (hicache/tiers/disk.py): records and
checksums (the protocol for opening the environment's directory is disk_env.py's).

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
disk_env.py).

Checksums. ``zlib.crc32`` runs at ~2.7 GB/s on this machine (LIMITS.md class),
less than half of LMDB's put rate and a fifteenth of a warm read, so it would
dominate both paths. The default ``sum64`` is a Fletcher-style sum over 4 KiB
blocks computed with numpy (~30 GB/s, GIL released): ``a`` = sum of all 64-bit
words, ``b`` = sum of (block index + 1) * block sum, both mod 2**64. Any change
confined to one 64-bit word (bit flips), any garbage, zeroed or stale sector
(probability of a miss ~2**-64) and any swap or misplacement of 4 KiB blocks
is caught; a swap of two words inside one block is not — not a failure mode of
disks or of LMDB. ``crc32`` stays selectable, and the default ``auto`` uses it
for pages under 16 KiB, where sum64's fixed ~5 us of numpy calls dominate. The
algorithm id is stored per record, so every kind reads back whatever is
configured.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np

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

CHECKSUM_SUM64 = 1
CHECKSUM_CRC32 = 2
CHECKSUM_IDS = {"sum64": CHECKSUM_SUM64, "crc32": CHECKSUM_CRC32}
CHECKSUM_NAMES = ("auto", *CHECKSUM_IDS)
_ALGO_IDS = frozenset(CHECKSUM_IDS.values())
# "auto": below this size crc32 is cheaper than sum64's ~5 us of numpy call overhead
AUTO_CRC32_BELOW = 16 << 10

_INFO = struct.Struct("<16sIId")  # magic, version, reserved, created (unix s)
_TOTALS = struct.Struct("<QQ")  # used_bytes, num_pages
# parent, salt, size, checksum a, checksum b, last_access, n_tokens, algo, flags
META_HEADER = struct.Struct("<16s16sQQQdIHH")
META_HEADER_BYTES = META_HEADER.size  # 72; the int32 tokens follow, 4-byte aligned
_FLAG_HAS_PARENT = 1
_OFF_LAST_ACCESS = 16 + 16 + 8 + 8 + 8
_NO_PARENT = bytes(KEY_BYTES)

_BLOCK_WORDS = 512  # 4 KiB blocks
# copy_checksum's chunk: small enough that a chunk of source and destination
# stays in L2 (2 MiB per core here), large enough that the two numpy calls per
# chunk stay cheap (1 MiB pages, vs copy then checksum: 32 and 64 KiB chunks
# lose, 128 KiB ties, 256 and 512 KiB win).
FUSE_CHUNK_BYTES = 256 << 10
# rows: 1 (plain sum), i + 1 (position weight); 4096 blocks = pages up to 16 MiB
_weights = np.stack([np.ones(4096, dtype=np.uint64), np.arange(1, 1 + 4096, dtype=np.uint64)])


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


def pick_algo(name: str, nbytes: int) -> int:
    """The algorithm id for a new record of `nbytes` under configuration `name`."""
    if name == "auto":
        return CHECKSUM_CRC32 if nbytes < AUTO_CRC32_BELOW else CHECKSUM_SUM64
    return CHECKSUM_IDS[name]


def checksum(algo: int, data: np.ndarray) -> tuple[int, int]:
    """Checksum of a flat uint8 array with the algorithm id `algo`."""
    if algo == CHECKSUM_SUM64:
        return _sum64(data)
    if algo == CHECKSUM_CRC32:
        return zlib.crc32(data), 0
    raise ValueError(f"unknown checksum algorithm id {algo}")


def _sum64(data: np.ndarray) -> tuple[int, int]:
    n = data.size
    n_full = n >> 12
    if n & 4095 == 0:  # the common case: whole 4 KiB blocks, four numpy calls
        blocks = np.add.reduce(data.view("<u8").reshape(n_full, _BLOCK_WORDS), axis=1)
    else:
        tail = data[n_full << 12:]
        pad = np.zeros(-tail.size % 8, dtype=np.uint8)
        last = np.add.reduce(np.concatenate([tail, pad]).view("<u8"), keepdims=True)
        if n_full:
            head = np.add.reduce(data[:n_full << 12].view("<u8").reshape(n_full, _BLOCK_WORDS), axis=1)
            blocks = np.concatenate([head, last])
        else:
            blocks = last
    return _combine(blocks)


def _combine(blocks: np.ndarray) -> tuple[int, int]:
    k = blocks.size
    w = _weights[:, :k] if k <= _weights.shape[1] else \
        np.stack([np.ones(k, dtype=np.uint64), np.arange(1, 1 + k, dtype=np.uint64)])
    a, b = (w @ blocks).tolist()  # uint64 arithmetic wraps modulo 2**64, no warnings
    return a, b


def copy_checksum(algo: int, src: np.ndarray, dst: np.ndarray) -> tuple[int, int]:
    """Copy flat uint8 `src` into `dst` (same size) and return the checksum of `dst`.

    For sum64 pages above FUSE_CHUNK_BYTES the copy and the block sums go
    chunk by chunk, so the sums read each chunk of `dst` from L2 right after
    it was written instead of from memory in a second pass (1-2 MiB pages
    outgrow L2 with source and destination both passing through it). Same
    result as ``checksum(algo, dst)`` after the copy."""
    n = dst.size
    if algo != CHECKSUM_SUM64 or n <= FUSE_CHUNK_BYTES or n & 4095:
        np.copyto(dst, src)
        return checksum(algo, dst)
    k = n >> 12
    words = dst.view("<u8").reshape(k, _BLOCK_WORDS)
    blocks = np.empty(k, dtype=np.uint64)
    step = FUSE_CHUNK_BYTES >> 12  # 4 KiB blocks per chunk
    for lo in range(0, k, step):
        hi = min(k, lo + step)
        np.copyto(dst[lo << 12:hi << 12], src[lo << 12:hi << 12])
        np.add.reduce(words[lo:hi], axis=1, out=blocks[lo:hi])
    return _combine(blocks)


class ChecksumJob:
    """Checksums of one batch's big pages, computed in order on the hasher
    thread while the writer copies earlier pages into the map (one task per
    batch: a Future per page costs more than a small page's checksum)."""

    def __init__(self, ops: list) -> None:  # objects with .page, .algo and .digest
        self.ops = ops
        self.cond = threading.Condition(threading.Lock())
        self.finished = False

    def run(self) -> None:
        try:
            for op in self.ops:
                op.digest = checksum(op.algo, np.frombuffer(op.page, dtype=np.uint8))
                with self.cond:
                    self.cond.notify()
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify()

    def digest(self, op) -> tuple[int, int]:
        if op.digest is None:
            with self.cond:
                self.cond.wait_for(lambda: op.digest is not None or self.finished)
        if op.digest is None:  # the job failed: compute it here
            op.digest = checksum(op.algo, np.frombuffer(op.page, dtype=np.uint8))
        return op.digest


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
