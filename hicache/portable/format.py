"""The portable export file format: one namespace's disk tier, as a self-checking stream.

A fresh node is warmed by importing what another node exported
(`hicache export --namespace NS FILE`, then `hicache import FILE`).

File format (version 2; every integer little-endian, no pickle)::

    file header  magic b"HICACHEX" | version u16 | flags u16 (0) | n u32
                 | descriptor: n bytes of msgpack | crc32 u32 of everything before it
    page record  b"P" | key 16 | parent 16 (zeros for a first page) | has_parent u8
                 | n_tokens u32 | page_len u32 | tokens int32 x n_tokens | page bytes
                 | XXH3-64 u64 of everything before it in the record
    end record   b"E" | pages u64 | page bytes u64 | XXH3-64 u64 of everything before it

Version 1 files (written by older builds) differ only in the records' check: a
crc32 u32 instead of the XXH3-64 u64. They are still read and imported; new
files are always version 2 (XXH3 runs at ~60 GB/s here, crc32 at ~2.7, and
XXH3's 64 bits leave a damaged record a 2**-64 chance instead of 2**-32).

The descriptor is a map: ``model``, ``layout`` (KVLayout.to_dict), ``tp_rank``,
``tp_size``, ``extra_key``, ``page_bytes``, ``salt`` (16 bytes) and, for humans,
``hicache_version`` and ``created`` (unix seconds). The salt must be the one the
descriptor hashes to, and ``page_bytes`` the layout's.

Page records come parents first, depth first: every page's parent is either
absent (the page starts a sequence) or on the path from a root to the page
before it. So an importer checks and indexes each chunk as it arrives, keeping
only that path. A page is verified by its checksum AND by its key: the key must
be the chained hash of (parent key, tokens) under the namespace's salt
(hicache.index.keys.page_keys), so tokens and parent links cannot be wrong
unnoticed; a keyed engine's named page (hicache.client.keyed) hashes (salt,
tokens) wherever it hangs, its name already committing to its prefix. The end record carries the totals, so a truncated file is detected.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from hicache import __version__
from hicache.errors import HiCacheError, LayoutError
from hicache.index.keys import KEY_BYTES, Namespace, page_keys
from hicache.layout import KVLayout

MAGIC = b"HICACHEX"
FORMAT_VERSION = 2  # what this build writes
READ_VERSIONS = (1, 2)  # what it reads
FILE_HEAD = struct.Struct("<8sHHI")  # magic, version, flags, descriptor length
CRC = struct.Struct("<I")  # the file header's check, and the records' in version 1
XXH3 = struct.Struct("<Q")  # the records' check from version 2 on
PAGE_HEAD = struct.Struct("<c16s16sBII")  # tag, key, parent, has_parent, n_tokens, page_len
END = struct.Struct("<cQQ")  # tag, pages, page bytes
TAG_PAGE = b"P"
TAG_END = b"E"
NO_PARENT = bytes(KEY_BYTES)
MAX_DESCRIPTOR_BYTES = 1 << 16
DEFAULT_CHUNK_BYTES = 8 << 20
MAX_EXPORT_CHUNK_BYTES = 64 << 20


class PortableFormatError(HiCacheError):
    """An export file (or chunk) is not a valid hicache export, or not one this daemon can take."""


# -- codec (shared by the CLI and the daemon) ---------------------------------------------

@dataclass(frozen=True, slots=True)
class ExportHeader:
    namespace: Namespace
    page_bytes: int
    salt: bytes
    version: int = FORMAT_VERSION  # of the file: decides the records' check

    @property
    def page_size(self) -> int:
        return self.namespace.layout.page_size

    @classmethod
    def for_namespace(cls, namespace: Namespace) -> ExportHeader:
        return cls(namespace, namespace.layout.page_bytes, namespace.salt())

    def encode(self) -> bytes:
        n = self.namespace
        desc = msgpack.packb({"model": n.model, "layout": n.layout.to_dict(), "tp_rank": n.tp_rank,
                              "tp_size": n.tp_size, "extra_key": n.extra_key, "page_bytes": self.page_bytes,
                              "salt": self.salt, "hicache_version": __version__, "created": time.time()},
                             use_bin_type=True)
        head = FILE_HEAD.pack(MAGIC, self.version, 0, len(desc)) + desc
        return head + CRC.pack(zlib.crc32(head))


def header_length(prefix: bytes) -> int:
    """Total length of the file header, given its first FILE_HEAD.size bytes."""
    if len(prefix) < FILE_HEAD.size or prefix[:len(MAGIC)] != MAGIC:
        raise PortableFormatError("not a hicache export file (bad magic)")
    _, version, _, n = FILE_HEAD.unpack_from(prefix)
    if version not in READ_VERSIONS:
        raise PortableFormatError(f"export format version {version}; this hicache reads versions "
                                  f"{', '.join(map(str, READ_VERSIONS))} (import the file with the hicache "
                                  "release that wrote it, or a newer one)")
    if n > MAX_DESCRIPTOR_BYTES:
        raise PortableFormatError(f"export header of {n} bytes is implausible (damaged file?)")
    return FILE_HEAD.size + n + CRC.size


def decode_header(buf: bytes) -> ExportHeader:
    """Parse and check a whole file header (exactly header_length bytes)."""
    total = header_length(buf[:FILE_HEAD.size])
    if len(buf) != total:
        raise PortableFormatError(f"export header is {len(buf)} bytes, expected {total} (truncated file?)")
    (crc,) = CRC.unpack_from(buf, total - CRC.size)
    if zlib.crc32(buf[:total - CRC.size]) != crc:
        raise PortableFormatError("export header checksum mismatch (damaged file)")
    try:
        desc = msgpack.unpackb(buf[FILE_HEAD.size:total - CRC.size], raw=False)
        layout = KVLayout.from_dict(desc["layout"])
        namespace = Namespace(desc["model"], layout, desc["tp_rank"], desc["tp_size"], desc["extra_key"])
        page_bytes, salt = desc["page_bytes"], desc["salt"]
        if not (isinstance(namespace.model, str) and isinstance(namespace.extra_key, str)
                and all(type(x) is int for x in (namespace.tp_rank, namespace.tp_size, page_bytes))):
            raise TypeError("descriptor fields have the wrong types")
    except (LayoutError, TypeError, KeyError, ValueError, AttributeError, msgpack.UnpackException) as e:
        raise PortableFormatError(f"export header descriptor is malformed: {e}") from None
    if not 0 <= namespace.tp_rank < namespace.tp_size:
        raise PortableFormatError("export header: need 0 <= tp_rank < tp_size")
    if page_bytes != layout.page_bytes:
        raise PortableFormatError(f"export header: page_bytes {page_bytes} != the layout's {layout.page_bytes}")
    if salt != namespace.salt():
        raise PortableFormatError("export header: the namespace salt does not match its descriptor")
    return ExportHeader(namespace, page_bytes, salt, FILE_HEAD.unpack_from(buf)[1])


def check_bytes(version: int) -> int:
    """Size of the check that ends each record of a file of `version`."""
    return CRC.size if version == 1 else XXH3.size


def page_record_bytes(header: ExportHeader) -> int:
    return PAGE_HEAD.size + header.page_size * 4 + header.page_bytes + check_bytes(header.version)


def encode_page(key: bytes, parent: bytes | None, tokens: bytes, page: bytes | bytearray | memoryview) -> bytes:
    """A page record of a version-2 file."""
    head = PAGE_HEAD.pack(TAG_PAGE, key, parent or NO_PARENT, parent is not None, len(tokens) // 4, len(page))
    check = xxhash.xxh3_64(head)
    check.update(tokens)
    check.update(page)
    return b"".join((head, tokens, page, XXH3.pack(check.intdigest())))


def encode_end(num_pages: int, page_bytes_total: int) -> bytes:
    """The end record of a version-2 file."""
    body = END.pack(TAG_END, num_pages, page_bytes_total)
    return body + XXH3.pack(xxhash.xxh3_64_intdigest(body))


def record_rest(head: bytes, version: int = FORMAT_VERSION) -> int:
    """Bytes after a record's fixed head (PAGE_HEAD, or END for an end record) up to its end."""
    if head[:1] == TAG_PAGE:
        _, _, _, _, n_tokens, page_len = PAGE_HEAD.unpack_from(head)
        return n_tokens * 4 + page_len + check_bytes(version)
    return check_bytes(version)


def _check_ok(rec: memoryview, version: int) -> bool:
    """Whether a whole record's trailing check matches everything before it."""
    if version == 1:
        return zlib.crc32(rec[:-CRC.size]) == CRC.unpack_from(rec, len(rec) - CRC.size)[0]
    return xxhash.xxh3_64_intdigest(rec[:-XXH3.size]) == XXH3.unpack_from(rec, len(rec) - XXH3.size)[0]


def page_head(head: bytes, header: ExportHeader, where: str) -> tuple[bytes, bytes | None]:
    """A page record's key and parent, once the sizes its head declares are the header's.
    Readers call this before reading (or summing) anything after the head: a damaged size
    must not make them read gigabytes to find out."""
    _, key, parent, has_parent, n_tokens, page_len = PAGE_HEAD.unpack_from(head)
    if n_tokens != header.page_size or page_len != header.page_bytes:
        raise PortableFormatError(f"{where}: {n_tokens} tokens / {page_len} bytes, but the namespace's "
                                  f"pages hold {header.page_size} tokens / {header.page_bytes} bytes")
    return key, parent if has_parent else None


def head_size(tag: bytes) -> int:
    if tag == TAG_PAGE:
        return PAGE_HEAD.size
    if tag == TAG_END:
        return END.size
    raise PortableFormatError(f"unknown record tag {tag!r} (damaged file)")


@dataclass(slots=True)
class PageRecord:
    key: bytes
    parent: bytes | None
    tokens: np.ndarray  # int32, a view over the chunk
    page: memoryview  # a view over the chunk


def parse_records(buf: bytes, header: ExportHeader, first: int = 1
                  ) -> tuple[list[PageRecord], tuple[int, int] | None]:
    """Parse and verify a run of records (numbered from `first` in messages): checksums,
    sizes and the key chain. Returns the pages and the end record's totals when the run
    ends with one. Raises PortableFormatError."""
    mv = memoryview(buf)
    pages: list[PageRecord] = []
    end: tuple[int, int] | None = None
    pos = 0
    while pos < len(buf):
        where = f"record {first + len(pages)}"
        if end is not None:
            raise PortableFormatError(f"{where}: data after the end record")
        tag = bytes(mv[pos:pos + 1])
        size = head_size(tag)
        if pos + size > len(buf):
            raise PortableFormatError(f"{where}: truncated")
        head = bytes(mv[pos:pos + size])
        if tag == TAG_PAGE:
            key, parent_key = page_head(head, header, where)  # sizes first, then the checksum
        total = size + record_rest(head, header.version)
        if pos + total > len(buf):
            raise PortableFormatError(f"{where}: truncated")
        rec = mv[pos:pos + total]
        if not _check_ok(rec, header.version):
            raise PortableFormatError(f"{where}: checksum mismatch (damaged file)")
        if tag == TAG_END:
            _, n, nbytes = END.unpack_from(rec)
            end = (n, nbytes)
        else:
            tok_end = PAGE_HEAD.size + header.page_size * 4
            tokens = np.frombuffer(rec[PAGE_HEAD.size:tok_end], dtype="<i4")
            if page_keys(header.salt, tokens, header.page_size, parent=parent_key)[0] != key \
                    and (parent_key is None or page_keys(header.salt, tokens, header.page_size)[0] != key):
                raise PortableFormatError(f"{where}: key {key.hex()[:16]} is not the hash of its parent and tokens")
            pages.append(PageRecord(key, parent_key, tokens, rec[tok_end:tok_end + header.page_bytes]))
        pos += total
    return pages, end


@dataclass(slots=True, eq=False)
class PathEntry:
    key: bytes
    parent: bytes | None
    tokens: np.ndarray | None
    ok: bool | None = None  # None: in the chunk being written; False: not written or orphaned


class PathStack:
    """The root path of the last page seen. Depth-first order puts every page's parent on it."""

    def __init__(self) -> None:
        self.entries: list[PathEntry] = []
        self._pos: dict[bytes, int] = {}

    def copy(self) -> PathStack:
        other = PathStack()
        other.entries = list(self.entries)
        other._pos = dict(self._pos)
        return other

    def place(self, entry: PathEntry) -> PathEntry | None:
        """Put `entry` below its parent, dropping the branch left; returns the parent entry."""
        if entry.parent is None:
            depth, parent = 0, None
        else:
            i = self._pos.get(entry.parent)
            if i is None:
                raise PortableFormatError(f"page {entry.key.hex()[:16]} comes before its parent "
                                          f"{entry.parent.hex()[:16]} (records out of order)")
            depth, parent = i + 1, self.entries[i]
        for gone in self.entries[depth:]:
            self._pos.pop(gone.key, None)
        del self.entries[depth:]
        self.entries.append(entry)
        self._pos[entry.key] = depth
        return parent
