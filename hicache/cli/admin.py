"""Admin commands beyond one RPC: `hicache export`, `hicache import`, and the parsers and
dispatch of those and `hicache doctor` (doctor.py).

export  streams a namespace's disk pages into a portable file (format in
        hicache/portable/format.py), written to FILE.part and renamed when
        complete, so a failed export leaves no half file. FILE.part is created
        0600 and never through a link; a link or leftover at FILE.part, or
        anything but our own regular file at FILE, is refused
        (hicache/portable/files.py).
import  reads only a regular file. Its header goes to the daemon first
        (import_open checks the page size against its limits, changes
        nothing); then the WHOLE file is verified (checksums, key chain,
        order, totals), every record's declared sizes before the record is
        read, so a damaged or foreign file is refused before the daemon gets
        a page; then it is streamed in chunks, which the daemon verifies again.

File I/O goes through aiofiles and the RPCs through AsyncRpcConnection, so
reading the file overlaps the daemon's work on the previous chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiofiles

from hicache.config import admin_socket_path, format_size, parse_size
from hicache.portable.files import OutputFile, open_input
from hicache.portable.format import (
    FILE_HEAD, TAG_END, TAG_PAGE, ExportHeader, PathEntry, PathStack, PortableFormatError,
    decode_header, head_size, header_length, page_head, parse_records, record_rest,
)
from hicache.progress import Progress
from hicache.errors import ConfigError, HiCacheError

CHUNK_BYTES = 8 << 20
MAX_CHUNK_BYTES = 1 << 30
READ_BLOCK_BYTES = 4 << 20
EXPORT_OPEN_TIMEOUT_S = 600.0  # reads every page record of the disk tier
CHUNK_TIMEOUT_S = 300.0

def add_parsers(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--socket", dest="socket_path", help="daemon socket (default: as `hicache serve`)")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")

    def chunk(p: argparse.ArgumentParser) -> None:
        p.add_argument("--chunk-bytes", type=chunk_size, default=CHUNK_BYTES, metavar="SIZE",
                       help="page bytes per RPC (default 8MiB; at least one page goes in each)")

    p = sub.add_parser("doctor", help="check the daemon, its socket, memlock, shared memory and disk tier")
    common(p)
    p = sub.add_parser("export", help="write a namespace's disk pages to a portable file")
    common(p)
    p.add_argument("--namespace", required=True, metavar="NS", help="salt hex prefix (as `hicache ls`) or model")
    chunk(p)
    p.add_argument("file", help="output file")
    p = sub.add_parser("import", help="load a file written by `hicache export` into the disk tier")
    common(p)
    chunk(p)
    p.add_argument("file", help="input file")


def chunk_size(text: str) -> int:
    """--chunk-bytes: a size (`8MiB`), 1 byte to MAX_CHUNK_BYTES; a usage error otherwise."""
    try:
        value = parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 1 <= value <= MAX_CHUNK_BYTES:
        raise argparse.ArgumentTypeError(f"must be between 1 byte and {format_size(MAX_CHUNK_BYTES)}, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from hicache.cli.doctor import cmd_doctor
        return cmd_doctor(args)
    if args.command == "export":
        return asyncio.run(cmd_export(args))
    return asyncio.run(cmd_import(args))


def socket_path(args: argparse.Namespace) -> str:
    return admin_socket_path(args.socket_path)


def _emit(args: argparse.Namespace, result: dict, text: str) -> None:
    print(json.dumps(result) if args.json else text)


# -- export / import -----------------------------------------------------------------------

class _Reader:
    """Exact reads over an aiofiles file, in big blocks (one thread hop per block, not per record).

    `size` is the file's size when opened: a read that would run past it is refused before
    anything is read, so a damaged length cannot make the reader swallow a (sparse) file."""

    def __init__(self, f: Any, size: int) -> None:
        self.f = f
        self.size = size
        self.buf = bytearray()
        self.offset = 0  # of buf[0] in the file
        self.eof = False

    async def read_exact(self, n: int, what: str, at_boundary: bool = False) -> bytes | None:
        """n bytes; None at the end of the file when at_boundary (where a record may
        start); PortableFormatError when the file ends inside `what`."""
        if n > self.size - self.offset and not (at_boundary and self.offset >= self.size):
            raise PortableFormatError(f"the file is truncated inside {what}: {n} bytes from byte {self.offset}, "
                                      f"but it ends at byte {self.size}")
        while len(self.buf) < n and not self.eof:
            block = await self.f.read(max(READ_BLOCK_BYTES, n - len(self.buf)))
            if not block:
                self.eof = True
            self.buf += block
        if at_boundary and not self.buf:
            return None
        if len(self.buf) < n:
            raise PortableFormatError(f"the file is truncated inside {what} at byte {self.offset + len(self.buf)}")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.offset += n
        return out


@contextlib.asynccontextmanager
async def _open_export_file(path: str) -> AsyncIterator[tuple[_Reader, bytes, ExportHeader]]:
    """A regular file (never a fifo or device: open_input), read up to the end of its header."""
    fd = open_input(path)
    async with aiofiles.open(fd, "rb") as f:
        reader = _Reader(f, os.fstat(fd).st_size)
        raw, header = await _read_header(reader)
        yield reader, raw, header


@contextlib.contextmanager
def _file_errors(path: str, nothing_imported: bool) -> Iterator[None]:
    """One-line errors for a file that cannot be read or is not a valid export."""
    try:
        yield
    except OSError as e:
        raise HiCacheError(f"cannot read {path}: {e.strerror or e}") from None
    except PortableFormatError as e:
        note = "; nothing was imported" if nothing_imported else ""
        raise PortableFormatError(f"{path}: {e}{note}") from None


async def _read_header(reader: _Reader) -> tuple[bytes, ExportHeader]:
    prefix = await reader.read_exact(FILE_HEAD.size, "the file header", at_boundary=True)
    if prefix is None:
        raise PortableFormatError("the file is empty")
    raw = prefix + await reader.read_exact(header_length(prefix) - FILE_HEAD.size, "the file header")
    return raw, decode_header(raw)


async def _chunks(reader: _Reader, header: ExportHeader, max_bytes: int) -> AsyncIterator[bytes]:
    """Whole records, about max_bytes at a time; the last chunk holds the end record. The
    sizes a record declares are checked against the header (and the file's size) before the
    rest of it is read; the header's page size against the daemon's limits (import_open)."""
    parts: list[bytes] = []
    size = 0
    number = 1
    while True:
        tag = await reader.read_exact(1, "a record", at_boundary=True)
        if tag is None:
            raise PortableFormatError("the file is truncated: no end record")
        where = f"record {number}"
        head = tag + await reader.read_exact(head_size(tag) - 1, f"the header of {where}")
        if tag == TAG_PAGE:
            page_head(head, header, where)
        body = await reader.read_exact(record_rest(head, header.version), where)
        parts.append(head + body)
        size += len(head) + len(body)
        number += 1
        if tag == TAG_END:
            if await reader.read_exact(1, "the end", at_boundary=True) is not None:
                raise PortableFormatError("data after the end record")
            yield b"".join(parts)
            return
        if size >= max_bytes:
            yield b"".join(parts)
            parts, size = [], 0


async def verify_file(path: str) -> tuple[bytes, ExportHeader, int]:
    """Check a whole export file (checksums, key chain, order, totals); (header, descriptor, pages).
    Holds one chunk of records at a time; the caller has checked the header's page size."""
    async with _open_export_file(path) as (reader, raw, header):
        stack = PathStack()
        pages = 0
        shown = Progress("import: checking the file", unit="pages")
        async for chunk in _chunks(reader, header, CHUNK_BYTES):
            records, end = await asyncio.to_thread(parse_records, chunk, header, pages + 1)
            for r in records:
                stack.place(PathEntry(r.key, r.parent, None))
            pages += len(records)
            shown.update(pages)
            if end is not None and end != (pages, pages * header.page_bytes):
                raise PortableFormatError(f"the end record counts {end[0]} pages, the file holds {pages}")
        shown.close()
    return raw, header, pages


async def cmd_export(args: argparse.Namespace) -> int:
    from hicache.client.async_client import AsyncRpcConnection

    try:
        target = OutputFile(args.file)  # FILE.part: 0600, never through a link (hicache/portable/files.py)
    except OSError as e:
        raise HiCacheError(f"cannot write {args.file}: {e.strerror or e}") from None
    out = target.path
    try:
        try:
            fd = target.create()
        except OSError as e:
            raise HiCacheError(f"cannot write {target.part}: {e.strerror or e}") from None
        pending: asyncio.Future | None = None
        try:
            async with aiofiles.open(fd, "wb") as f:
                conn = await AsyncRpcConnection.connect(socket_path(args))
                try:
                    opened = await conn.call("export_open", {"namespace": args.namespace},
                                             timeout_s=EXPORT_OPEN_TIMEOUT_S)
                    params = {"export": opened["export"], "max_bytes": max(1, args.chunk_bytes)}
                    await f.write(opened["header"])
                    pending = asyncio.ensure_future(conn.call("export_next", params, timeout_s=CHUNK_TIMEOUT_S))
                    shown = Progress(f"export {args.namespace}", total=opened["pages"], unit="pages")
                    while True:
                        r = await pending
                        pending = None
                        shown.update(r["sent_pages"] + r["skipped_pages"])
                        if not r["done"]:  # the daemon reads the next chunk while this one is written
                            pending = asyncio.ensure_future(conn.call("export_next", params,
                                                                      timeout_s=CHUNK_TIMEOUT_S))
                        await f.write(r["data"])
                        if r["done"]:
                            break
                    shown.close()
                    await f.flush()
                    await asyncio.to_thread(os.fsync, f.fileno())
                    size = os.fstat(f.fileno()).st_size
                finally:
                    if pending is not None:
                        pending.cancel()
                    await conn.close()
            target.commit()
        except OSError as e:
            raise HiCacheError(f"cannot write {target.part}: {e.strerror or e}") from None
    finally:
        target.close()  # removes FILE.part unless committed
    sent, skipped = r["sent_pages"], r["skipped_pages"]
    result = {"file": str(out), "namespace": opened["namespace"], "model": opened["model"], "pages": sent,
              "skipped_pages": skipped, "file_bytes": size}
    note = f", {skipped} left out (evicted meanwhile)" if skipped else ""
    _emit(args, result, f"exported {sent} pages of {opened['namespace'][:16]} ({opened['model']}) to {out} "
                        f"({format_size(size)}){note}")
    return 0


async def cmd_import(args: argparse.Namespace) -> int:
    from hicache.client.async_client import AsyncRpcConnection

    path = args.file
    with _file_errors(path, nothing_imported=True):
        async with _open_export_file(path) as (_, raw, header):
            pass
    conn = await AsyncRpcConnection.connect(socket_path(args))
    try:
        # the daemon checks the header against its limits (page fits a host slab and a frame) and
        # changes nothing: pages it cannot take are refused before a record of the file is read
        opened = await conn.call("import_open", {"header": raw})
        with _file_errors(path, nothing_imported=True):
            checked, _, total = await verify_file(path)  # the whole file, before the daemon sees a page
            if checked != raw:
                raise PortableFormatError("the file changed during the import")
        with _file_errors(path, nothing_imported=False):
            async with _open_export_file(path) as (reader, again, _):
                if again != raw:
                    raise PortableFormatError("the file changed during the import")
                chunks = _chunks(reader, header, max(1, min(args.chunk_bytes, opened["max_chunk_bytes"])))
                data: bytes | None = await anext(chunks)
                read: asyncio.Future | None = None
                shown = Progress("import: sending", total=total, unit="pages")
                try:
                    while True:
                        call = asyncio.ensure_future(conn.call("import_pages", {"import": opened["import"],
                                                                                "data": data},
                                                                timeout_s=CHUNK_TIMEOUT_S))
                        read = asyncio.ensure_future(anext(chunks, None))  # reads while the daemon writes
                        r = await call
                        shown.update(r["imported_pages"] + r["skipped_pages"])
                        if r["done"]:
                            break
                        data, read = await read, None
                        if data is None:
                            raise PortableFormatError("the file changed during the import")
                finally:
                    shown.close()
                    if read is not None:
                        read.cancel()
    finally:
        await conn.close()
    n = header.namespace
    result = {"file": path, "namespace": opened["namespace"], "model": n.model, "pages": total,
              "imported_pages": r["imported_pages"], "skipped_pages": r["skipped_pages"]}
    note = f", {r['skipped_pages']} skipped (disk budget or queue)" if r["skipped_pages"] else ""
    _emit(args, result, f"imported {r['imported_pages']} of {total} pages into {opened['namespace'][:16]} "
                        f"({n.model} tp{n.tp_rank}/{n.tp_size}){note}")
    return 0
