"""Admin commands beyond one RPC: `hicache doctor`, `hicache export`, `hicache import`.

doctor  checks the socket (reachable, mode 0660, owner), the daemon (pid,
        version), memlock (the daemon's RLIMIT_MEMLOCK against its arena, and
        whether the arena is mlocked), shared memory (the arena's range and a
        slab memfd mapped here as an engine maps them, /dev/shm, vm.overcommit), the LMDB disk tier
        (use, corrupt pages, write errors, queue depth, reader slots, map use),
        free space where the state lives, and the age of the last disk commit.
        Each check is ok / warn / fail with one line; exit 1 if any fails, 2
        when the daemon cannot be reached.
export  streams a namespace's disk pages into a portable file (format in
        hicache/portable_format.py), written to FILE.part and renamed when
        complete, so a failed export leaves no half file. FILE.part is created
        0600 and never through a link; a link or leftover at FILE.part, or
        anything but our own regular file at FILE, is refused
        (hicache/portable_files.py).
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
import grp
import json
import os
import pwd
import stat
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiofiles

from hicache import __version__
from hicache.config import SERVICE_SOCKET, admin_socket_path, format_size, parse_size
from hicache.portable_files import OutputFile, open_input
from hicache.progress import Progress
from hicache.portable_format import (
    FILE_HEAD, TAG_END, TAG_PAGE, ExportHeader, PathEntry, PathStack, PortableFormatError,
    decode_header, head_size, header_length, page_head, parse_records, record_rest,
)
from hicache.errors import ConfigError, DaemonUnavailable, HiCacheError
from hicache.tiers.arena import HostArena, new_slab_memfd

SYSTEM_SOCKET = str(SERVICE_SOCKET)  # where hicache.socket listens
CHUNK_BYTES = 8 << 20
MAX_CHUNK_BYTES = 1 << 30
READ_BLOCK_BYTES = 4 << 20
EXPORT_OPEN_TIMEOUT_S = 600.0  # reads every page record of the disk tier
CHUNK_TIMEOUT_S = 300.0

# doctor thresholds
LOW_FREE_BYTES = 1 << 30
CRITICAL_FREE_BYTES = 64 << 20
STATE_EXTRA_WARN_BYTES = 64 << 20  # the namespaces sidecar, LMDB's lock file, the state marker: far less
SHM_LOW_BYTES = 64 << 20
MAP_FULL_WARN = 0.9
QUEUE_FULL_WARN = 0.8
READERS_FULL_WARN = 0.9
WRITER_STALL_S = 60.0  # pages queued and no commit for this long: the writer is stuck


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
        return cmd_doctor(args)
    if args.command == "export":
        return asyncio.run(cmd_export(args))
    return asyncio.run(cmd_import(args))


def socket_path(args: argparse.Namespace) -> str:
    return admin_socket_path(args.socket_path)


def _emit(args: argparse.Namespace, result: dict, text: str) -> None:
    print(json.dumps(result) if args.json else text)


# -- doctor ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def socket_check(path: str) -> Check:
    """The socket file itself; DaemonUnavailable when there is none to connect to."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        hint = ""
        if path != SYSTEM_SOCKET and os.path.exists(SYSTEM_SOCKET):
            hint = f"; the system service listens on {SYSTEM_SOCKET}: pass --socket {SYSTEM_SOCKET}"
        raise DaemonUnavailable(f"no socket at {path}{hint}") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot stat {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{path} exists but is not a socket")
    mode = stat.S_IMODE(st.st_mode)
    detail = f"{path}: mode {mode:04o}, owner {_owner(st)}"
    if mode & 0o007:
        return Check("socket", "warn", f"{detail}: other users can connect (expected 0660; peer uids are "
                                       "still checked)")
    if mode != 0o660:
        return Check("socket", "warn", f"{detail} (expected 0660: engines reach it through the group)")
    return Check("socket", "ok", detail)


def arena_check(hello: dict) -> Check:
    """Map as an engine maps the daemon's arena: reserve its address range, then put a
    sealed slab-sized memfd in it (the daemon sends each engine only the slabs of its own
    namespace, so the check brings its own)."""
    nbytes, slab_bytes, num_slabs = int(hello["arena_bytes"]), int(hello["slab_bytes"]), int(hello["num_slabs"])
    what = f"the {format_size(nbytes)} arena ({num_slabs} slabs of {format_size(slab_bytes)})"
    try:
        with HostArena.reserve(num_slabs, slab_bytes) as arena:
            arena.map_slab(num_slabs - 1, new_slab_memfd(slab_bytes, "hicache-doctor"), 1)
            arena.array[-1], arena.array[-slab_bytes]  # noqa: B018 - touch both ends of the slab
    except (OSError, HiCacheError) as e:
        return Check("arena", "fail", f"cannot map {what} as engines do: {e}")
    return Check("arena", "ok", f"{what} maps here as in an engine")


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def host_checks(arena_bytes: int) -> list[Check]:
    """Shared-memory limits of this machine (the daemon's, when run on its host)."""
    checks: list[Check] = []
    try:
        vfs = os.statvfs("/dev/shm")
        size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        detail = f"/dev/shm {format_size(size)}, {format_size(free)} free (engines' NCCL/torch IPC; the arena is a memfd)"
        checks.append(Check("shm", "warn" if free < SHM_LOW_BYTES else "ok", detail))
    except OSError as e:
        checks.append(Check("shm", "warn", f"/dev/shm unusable ({e.strerror}): engines' NCCL/torch IPC need it"))
    try:
        mode = int(Path("/proc/sys/vm/overcommit_memory").read_text())
    except (OSError, ValueError):
        checks.append(Check("overcommit", "ok", "vm.overcommit_memory unreadable; skipped"))
        return checks
    if mode == 2:
        info = _meminfo()
        room = info.get("CommitLimit", 0) - info.get("Committed_AS", 0)
        status = "warn" if room < arena_bytes else "ok"
        checks.append(Check("overcommit", status, f"vm.overcommit_memory=2 (strict): {format_size(max(room, 0))} "
                                                  "left to commit; engines' large allocations may fail"))
    else:
        checks.append(Check("overcommit", "ok", f"vm.overcommit_memory={mode}"))
    return checks


def daemon_checks(facts: dict) -> list[Check]:
    """Checks on what the daemon reported (its `doctor` RPC); pure, so it is testable."""
    checks: list[Check] = []
    version = facts["version"]
    detail = f"pid {facts['pid']}, hicache {version}, up {facts['uptime_s']:.0f}s, uid {facts['uid']}"
    if version != __version__:
        checks.append(Check("daemon", "warn", f"{detail}; this CLI is {__version__}"))
    else:
        checks.append(Check("daemon", "ok", detail))

    host = facts["host"]
    soft = facts["memlock_limit"][0]
    limit = "unlimited" if soft is None else format_size(soft)
    arena = format_size(host["capacity_bytes"])
    if host["locked"]:
        why = "" if soft is None or soft >= host["capacity_bytes"] else ", not binding: CAP_IPC_LOCK"
        checks.append(Check("memlock", "ok", f"arena of {arena} mlocked (RLIMIT_MEMLOCK {limit}{why})"))
    elif not host["mlock"]:
        checks.append(Check("memlock", "warn", f"mlock disabled in the config: the {arena} arena may be swapped out"))
    else:
        checks.append(Check("memlock", "warn", f"arena of {arena} not mlocked: RLIMIT_MEMLOCK is {limit}; "
                                               "set LimitMEMLOCK=infinity (or ulimit -l) for the daemon"))

    disk = facts.get("disk")
    if disk is None:
        checks.append(Check("disk", "ok", "no disk tier (--no-disk)"))
    else:
        checks.extend(_disk_checks(disk, facts["time"]))

    usage = facts.get("state_usage")  # an older daemon does not report it
    if usage is not None:
        checks.append(_state_usage_check(facts["state_dir"], usage))

    fs = facts["state_fs"]
    free, total = fs["free_bytes"], fs["total_bytes"]
    detail = f"{facts['state_dir']}: {format_size(free)} free of {format_size(total)}"
    if free < CRITICAL_FREE_BYTES:
        checks.append(Check("free disk", "fail", f"{detail}: the namespaces sidecar and logs cannot be written"))
    elif free < min(LOW_FREE_BYTES, total // 20):
        checks.append(Check("free disk", "warn", f"{detail}: low"))
    else:
        checks.append(Check("free disk", "ok", detail))
    return checks


def _state_usage_check(state_dir: str, usage: dict) -> Check:
    """What the state directory really takes (allocated blocks): the disk tier's file is its
    capacity, the rest is small; more means copies moved aside or files left by hand."""
    allocated, capacity = usage["allocated_bytes"], usage["disk_capacity"]
    detail = (f"{state_dir}: {format_size(allocated)} allocated in {usage['files']} files "
              f"(disk tier {format_size(capacity) if capacity else 'off'})")
    if allocated > capacity + STATE_EXTRA_WARN_BYTES:
        return Check("state dir", "warn", f"{detail}: more than the disk tier's capacity; "
                                          "look for quarantined copies (disk.corrupt-*)")
    return Check("state dir", "ok", detail)


def _disk_checks(disk: dict, now: float) -> list[Check]:
    checks: list[Check] = []
    used, cap = disk["used_bytes"], disk["capacity_bytes"]
    detail = (f"{disk['pages']} pages, {format_size(used)} of {format_size(cap)} "
              f"({disk['durability']} durability), queue {disk['queue_depth']}/{disk['max_queue_pages']}")
    problems = []
    if disk["corrupt_pages"]:
        problems.append(f"{disk['corrupt_pages']} corrupt pages dropped since start (check the storage)")
    if disk.get("write_errors"):
        problems.append(f"{disk['write_errors']} failed write transactions")
    if disk["queue_depth"] >= QUEUE_FULL_WARN * disk["max_queue_pages"]:
        problems.append("the write queue is nearly full (writes are being skipped)")
    map_use = disk["map_used_bytes"] / max(1, disk["map_size"])
    if map_use >= MAP_FULL_WARN:
        problems.append(f"the LMDB map is {map_use:.0%} used")
    checks.append(Check("lmdb", "warn" if problems else "ok", "; ".join([detail, *problems])))

    readers, slots = disk["num_readers"], disk["max_readers"]
    detail = f"{readers} of {slots} reader slots in use"
    if disk["stale_readers_cleared"]:
        checks.append(Check("lmdb readers", "warn", f"{detail}; cleared {disk['stale_readers_cleared']} stale "
                                                    "slots of dead processes"))
    elif readers >= READERS_FULL_WARN * slots:
        checks.append(Check("lmdb readers", "warn", f"{detail}: nearly exhausted"))
    else:
        checks.append(Check("lmdb readers", "ok", detail))

    last = disk["last_write_time"]
    if not last:
        status = "fail" if disk["queue_depth"] else "ok"
        detail = "no disk commit since the daemon started" + (f", {disk['queue_depth']} queued" if status == "fail"
                                                               else "")
        checks.append(Check("last write", status, detail))
    else:
        age = max(0.0, now - last)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))
        if disk["queue_depth"] and age > WRITER_STALL_S:
            checks.append(Check("last write", "fail", f"last commit {age:.0f}s ago ({when}) with "
                                                      f"{disk['queue_depth']} writes queued: the writer is stuck"))
        else:
            checks.append(Check("last write", "ok", f"last commit {age:.0f}s ago ({when})"))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    from hicache.client.connection import RpcConnection

    path = socket_path(args)
    checks = [socket_check(path)]
    try:
        conn = RpcConnection.connect(path, timeout_s=10.0)
    except DaemonUnavailable as e:
        if not os.access(path, os.R_OK | os.W_OK):
            st = os.stat(path)
            raise DaemonUnavailable(f"{e.message} (socket owner {_owner(st)}, mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}: join its group)") from None
        raise
    try:
        hello, fds = conn.hello()
        for fd in fds:
            os.close(fd)
        checks.append(arena_check(hello))
        facts = conn.call("doctor")
    finally:
        conn.close()
    reported = daemon_checks(facts)
    # socket, daemon, memlock, arena, shared memory, then the disk: the order an operator reads
    checks = [checks[0], *reported[:2], checks[1], *host_checks(facts["host"]["capacity_bytes"]), *reported[2:]]
    failures = sum(c.status == "fail" for c in checks)
    warnings = sum(c.status == "warn" for c in checks)
    if args.json:
        print(json.dumps({"socket": path, "checks": [asdict(c) for c in checks], "failures": failures,
                          "warnings": warnings, "daemon": facts}))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<5} {c.name:<{width}}  {c.detail}")
        print(f"{failures} failed, {warnings} warnings")
    return 1 if failures else 0


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
        target = OutputFile(args.file)  # FILE.part: 0600, never through a link (hicache/portable_files.py)
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
