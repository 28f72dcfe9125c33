"""The export format's record checks, without a daemon: version 2 (XXH3-64) catches what
crc32 and plain sums can miss; version 1 files (crc32) still parse; others are refused."""

from __future__ import annotations

import zlib

import pytest

from hicache.index.keys import Namespace, page_keys
from hicache.portable.format import (
    CRC, FILE_HEAD, XXH3, ExportHeader, PortableFormatError, decode_header, encode_end, encode_page, parse_records,
)
from tests.daemon.engine_worker import LAYOUTS, tokens_for

HEADER = ExportHeader.for_namespace(Namespace("test-model", LAYOUTS["mha"]))


def _pages(n: int = 3) -> list[bytes]:
    tokens = tokens_for(7, 4 * n)
    keys = page_keys(HEADER.salt, tokens, 4)
    return [encode_page(k, keys[i - 1] if i else None, tokens[4 * i:4 * i + 4].tobytes(),
                        bytes(range(256)) * (HEADER.page_bytes // 256)) for i, k in enumerate(keys)]


def _as_version_1(record: bytes) -> bytes:
    body = record[:-XXH3.size]
    return body + CRC.pack(zlib.crc32(body))


def test_version_2_records_parse_and_swapped_words_are_caught():
    pages = _pages()
    got, end = parse_records(b"".join(pages) + encode_end(3, 3 * HEADER.page_bytes), HEADER)
    assert [p.key for p in got] == [p[1:17] for p in pages] and end == (3, 3 * HEADER.page_bytes)
    swapped = bytearray(pages[1])
    at = len(swapped) - XXH3.size - 64  # two neighbouring 8-byte words of the page
    swapped[at:at + 8], swapped[at + 8:at + 16] = swapped[at + 8:at + 16], swapped[at:at + 8]
    assert bytes(swapped) != pages[1]
    with pytest.raises(PortableFormatError, match="record 2: checksum mismatch"):
        parse_records(pages[0] + bytes(swapped), HEADER)


def test_version_1_files_still_parse_with_their_crc32():
    raw = bytearray(HEADER.encode()[:-CRC.size])
    FILE_HEAD.pack_into(raw, 0, *(FILE_HEAD.unpack_from(raw)[:1] + (1,) + FILE_HEAD.unpack_from(raw)[2:]))
    old = decode_header(bytes(raw) + CRC.pack(zlib.crc32(raw)))
    assert old.version == 1 and old.salt == HEADER.salt
    pages = [_as_version_1(p) for p in _pages()]
    end = _as_version_1(encode_end(3, 3 * HEADER.page_bytes))
    got, totals = parse_records(b"".join(pages) + end, old)
    assert len(got) == 3 and totals == (3, 3 * HEADER.page_bytes)
    flipped = bytearray(pages[2])
    flipped[100] ^= 1
    with pytest.raises(PortableFormatError, match="record 3: checksum mismatch"):
        parse_records(pages[0] + pages[1] + bytes(flipped), old)
    with pytest.raises(PortableFormatError):  # a version 2 record read as version 1 does not pass
        parse_records(_pages()[0], old)


def test_an_unknown_version_is_refused_by_name():
    raw = bytearray(HEADER.encode())
    raw[8] = 9
    with pytest.raises(PortableFormatError, match="format version 9; this hicache reads versions 1, 2"):
        decode_header(bytes(raw))
