"""Records of the remote tier (L4): one self-describing value per page.

A remote store is shared by many daemons and outlives them all, so hicache
trusts nothing it reads back: every record names what it holds and is checked
field by field before a byte of it reaches the host arena.

Layout (little-endian), then the page's tokens as int32, then the page bytes:

    magic "HCR1" | version u16 | checksum algo u16 | namespace salt 16 | page key 16 |
    parent key 16 (zeros: first page) | layout fingerprint 16 | flags u32 | n_tokens u32 |
    page bytes u64 | checksum a u64 | checksum b u64 | header crc32 u32 | key id u32 | mac 32

- Version 2 (this daemon writes it) added the key id and MAC (144-byte header);
  version 1 records (112 bytes: a reserved u32 where the key id is, no MAC) are
  read as unauthenticated records. The MAC (flag bit 2; hicache/tiers/remote/auth.py)
  is HMAC-SHA256 under a cluster secret over the whole record but the MAC itself;
  with a secret configured a record is refused (reason "unsigned") unless it
  carries one, and (reason "mac") unless it verifies under a secret this daemon
  holds. It is checked before the page is copied out. Without a secret, records
  are written unsigned and a MAC that is present is not checked.
- The page checksum is the disk tier's (`tiers/disk/format.py`'s `checksum`: XXH3-64 in
  checksum a, 0 in b, algo 3), computed over the page right before it is
  copied into the record and verified back to back with the copy out into
  the arena (`copy_verified` of tiers/disk/format.py), while the bytes are in the cache. Records of older daemons (algo 1, sum64; algo 2,
  crc32) are still verified and served: a store shared across a rolling
  upgrade keeps its pages. An older daemon refuses algo 3 as a "format" error
  (a miss), never serves it.
- The header crc32 covers the header before it and the tokens (a few hundred
  bytes: crc32 is cheap there and catches every burst up to 32 bits).
- The page key must equal BLAKE2b(parent or salt || tokens): the same chain the
  engines compute (hicache.index.keys), so a record can only be served as the page
  whose tokens it carries, under the parent the reader already holds.

Any failed check is a `RecordError`: the reader counts it as a corrupt record
and treats the page as a miss. These checks catch corruption, truncation, a
record of another namespace, layout or format version, and misplaced records;
without a secret they do not stop a writer with access to the store from forging
a consistent record (see README, "Remote tier": what an unauthenticated setup trusts).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import zlib

import numpy as np

from hicache.index.keys import KEY_BYTES
from hicache.tiers.disk import format as fmt
from hicache.tiers.remote.auth import MAC_BYTES, RecordAuth, mac

MAGIC = b"HCR1"
VERSION = 2
_VERSIONS = (1, 2)
_HEAD = struct.Struct("<4sHH16s16s16s16sIIQQQ")
_CRC = struct.Struct("<II")  # header crc32, key id (version 1: reserved)
_SIGNED = _HEAD.size + _CRC.size  # 112: where the MAC sits; the whole version 1 header
HEADER_BYTES = _SIGNED + MAC_BYTES  # 144: the tokens after it stay 8-byte aligned
_FLAG_HAS_PARENT = 1
_FLAG_MAC = 2
_NO_MAC = bytes(MAC_BYTES)
_NO_PARENT = bytes(KEY_BYTES)
_ALGOS = frozenset((fmt.CHECKSUM_SUM64, fmt.CHECKSUM_CRC32, fmt.CHECKSUM_XXH3))


class RecordError(ValueError):
    """A record failed a check; `reason` is a short stable word for counters and logs."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def record_bytes(page_size: int, page_bytes: int) -> int:
    return HEADER_BYTES + 4 * page_size + page_bytes


class BufferPool:
    """Record buffers reused from one put to the next. A fresh bytearray of a page's size
    costs more than building the record in it (it is zeroed, then faulted in page by page:
    0.4-1.9 GB/s here for 1 MiB, against ~10 GB/s for the copy with its checksum; with
    64 MiB kept, puts of 1 MiB pages ran at 0.33 of plain redis-py SETs, with 512 MiB at
    0.77). Thread-safe; keeps at most `max_bytes` of idle buffers: no more than the
    write queue (remote_queue_pages) ever has in flight."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                self._idle_bytes -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, bufs: list) -> None:
        with self._lock:
            for buf in bufs:
                buf = buf.obj if isinstance(buf, memoryview) else buf
                if self._idle_bytes + len(buf) <= self.max_bytes:
                    self._idle.setdefault(len(buf), []).append(buf)
                    self._idle_bytes += len(buf)


def encode(salt: bytes, key: bytes, parent: bytes | None, fingerprint: bytes, tokens: np.ndarray,
           page: memoryview | np.ndarray, pool: BufferPool | None = None, auth: RecordAuth | None = None
           ) -> memoryview:
    """One record (in a buffer of `pool`, given back by the caller once sent); the page is
    checksummed, then copied into it once; with `auth`, signed with its first secret."""
    toks = np.ascontiguousarray(tokens, dtype="<i4")
    src = np.frombuffer(page, dtype=np.uint8)
    size = HEADER_BYTES + toks.nbytes + src.size
    buf = pool.take(size) if pool is not None else bytearray(size)
    arr = np.frombuffer(buf, dtype=np.uint8)
    tok_end = HEADER_BYTES + toks.nbytes
    arr[HEADER_BYTES:tok_end] = toks.view(np.uint8)
    a, b = fmt.checksum(src)
    fmt.copy_into(memoryview(buf)[tok_end:], src)
    flags = (_FLAG_HAS_PARENT if parent is not None else 0) | (_FLAG_MAC if auth is not None else 0)
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, fmt.CHECKSUM_XXH3, salt, key, parent or _NO_PARENT, fingerprint, flags,
                    len(toks), src.size, a, b)
    view = memoryview(buf)
    crc = zlib.crc32(view[tok_end - toks.nbytes:tok_end], zlib.crc32(view[:_HEAD.size]))
    _CRC.pack_into(buf, _HEAD.size, crc, auth.write_id if auth is not None else 0)
    # a pooled buffer holds the last record's MAC: always overwritten
    view[_SIGNED:HEADER_BYTES] = mac(auth.write_secret, _signed_parts(view)) if auth is not None else _NO_MAC
    return view


def _signed_parts(view: memoryview) -> tuple[memoryview, memoryview]:
    """What the MAC covers: everything but the MAC."""
    return view[:_SIGNED], view[HEADER_BYTES:]


def decode_into(blob: bytes | memoryview, *, salt: bytes, key: bytes, parent: bytes | None, fingerprint: bytes,
                page_size: int, out: np.ndarray, auth: RecordAuth | None = None) -> np.ndarray:
    """Check `blob` as the record of page `key` under `parent` and copy its page into `out`
    (a uint8 view of one host slot); returns the page's tokens. Raises RecordError.
    With `auth`, the record's MAC is verified before anything is copied into `out`.
    On an error `out` may hold part of the bad page: the caller must not use it."""
    view = memoryview(blob)
    if len(view) < _SIGNED:
        raise RecordError("truncated", f"{len(view)} bytes, less than a header")
    (magic, version, algo, r_salt, r_key, r_parent, r_fp, flags, n_tokens, n_bytes, a, b) = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise RecordError("format", "not a hicache record")
    if version not in _VERSIONS:
        raise RecordError("version", f"record format {version}, this daemon reads {_VERSIONS}")
    head_end = HEADER_BYTES if version >= 2 else _SIGNED
    if r_salt != salt or r_fp != fingerprint:
        raise RecordError("namespace", "the record belongs to another namespace or layout")
    if r_key != key:
        raise RecordError("key", "the record holds another page")
    want_parent = parent if parent is not None else _NO_PARENT
    if r_parent != want_parent or bool(flags & _FLAG_HAS_PARENT) != (parent is not None):
        raise RecordError("parent", "the record hangs under another parent")
    if n_tokens != page_size or n_bytes != out.size or algo not in _ALGOS:
        raise RecordError("format", f"{n_tokens} tokens, {n_bytes} bytes, checksum {algo}: not this layout's page")
    tok_end = head_end + 4 * n_tokens
    if len(view) != tok_end + n_bytes:
        raise RecordError("truncated", f"{len(view)} bytes, the header says {tok_end + n_bytes}")
    crc, kid = _CRC.unpack_from(view, _HEAD.size)
    if zlib.crc32(view[head_end:tok_end], zlib.crc32(view[:_HEAD.size])) != crc:
        raise RecordError("checksum", "header or tokens damaged")
    if auth is not None:
        _authenticate(view, version, flags, kid, auth)
    tok_bytes = bytes(view[head_end:tok_end])
    chained = hashlib.blake2b(want_parent if parent is not None else salt, digest_size=KEY_BYTES)
    chained.update(tok_bytes)
    if chained.digest() != key:
        raise RecordError("key", "the page key is not the hash of its parent and tokens")
    if not fmt.copy_verified(algo, view[tok_end:], memoryview(out).cast("B"), (a, b)):
        raise RecordError("checksum", "page bytes damaged")
    return np.frombuffer(tok_bytes, dtype="<i4")


def _authenticate(view: memoryview, version: int, flags: int, kid: int, auth: RecordAuth) -> None:
    if version < 2 or not flags & _FLAG_MAC:
        raise RecordError("unsigned", "the record carries no MAC and this daemon requires one")
    secret = auth.secret_for(kid)
    if secret is None:
        raise RecordError("mac", f"signed with key {kid:08x}, a secret this daemon does not hold")
    if not hmac.compare_digest(mac(secret, _signed_parts(view)), view[_SIGNED:HEADER_BYTES]):
        raise RecordError("mac", "the MAC does not verify: forged or damaged")
