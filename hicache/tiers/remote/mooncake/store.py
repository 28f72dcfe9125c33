"""MooncakeStore: the remote tier on Mooncake Store (`mooncake://MASTER_HOST:PORT`).

    mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&local_host=10.0.0.7

Options (query): `metadata` (the metadata server; default the master's built-in HTTP
one, `http://MASTER_HOST:8080/metadata`), `local_host` (the address this node's
transfer engine advertises; default the one that routes to the master), `protocol`
(`tcp`, or `rdma` with `device`), `staging_mib` (default 64).

The Mooncake client does not run in the daemon's process: with the master down its
`setup()` holds the GIL for about 90 s. A helper process (hicache/tiers/remote/mooncake/helper.py)
runs it; this class talks to it over a socketpair and shares a memfd with it, the
staging area: records are copied in before a put and out after a get (the copies the
Redis backend makes into and out of its socket buffers), and the helper moves them
with zero-copy calls on that area, registered once. Every call is bounded by the
caller's deadline (a cancelled call leaves its staging space and its slot reserved until
the helper answers), and at most HELPER_THREADS calls are outstanding, a few slots kept
for probes: a master that blocks each call for ~4 s piles up no threads and no queue.

Semantics against Redis:
- Writes use `upsert` (overwrite), so a damaged or forged record is replaced by the
  next honest writer as on Redis; Mooncake's `put` would keep the first write forever.
- No per-record TTL: `remote_ttl_s` is not enforced; records live until the store
  evicts them (oldest first, about 5% when 90% full), an admin flush, or a master
  restart without HA (which loses every key).
- No credentials (Mooncake has no authentication): `remote_password_file` is refused;
  use `remote_secret_file` so that records are signed and verified.
Key layout: `hc1:<salt hex>:<page key hex>` (no run tag: the master places objects).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from hicache.errors import ConfigError
from hicache.tiers.remote.mooncake.helper import FRAME, frame
from hicache.tiers.remote.mooncake.staging import Staging
from hicache.tiers.remote.store import PageAddress, PartialWrite, RemoteStore, RemoteStoreError

log = logging.getLogger(__name__)

DEFAULT_METADATA_PORT = 8080
DEFAULT_STAGING_MIB = 64
# Calls outstanding in the helper at most, per kind: probes (exists, ping) never queue
# behind transfers, and together they never exceed the helper's threads, so nothing
# waits inside the helper; a caller beyond them waits here, bounded by its deadline.
MAX_PROBES = 4
MAX_TRANSFERS = 4
HELPER_THREADS = MAX_PROBES + MAX_TRANSFERS
PROBE_OPS = ("exists",)
RESPAWN_AFTER_S = 30.0  # a helper that has failed every ping this long is replaced
NOT_FOUND = -704
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room
OPTIONS = ("metadata", "local_host", "protocol", "device", "staging_mib")


def parse_url(url: str) -> dict[str, Any]:
    """The helper's options from a `mooncake://` URL; ConfigError for a bad one."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as e:
        raise ConfigError(f"remote_url {url!r} is not a valid URL: {e}") from None
    if parts.scheme != "mooncake" or not parts.hostname or not port:
        raise ConfigError(f"remote_url {url!r}: expected mooncake://MASTER_HOST:PORT")
    if parts.username or parts.password:
        raise ConfigError(f"remote_url {parts.scheme}://***@...: Mooncake Store has no credentials; "
                          "sign records with remote_secret_file instead")
    unknown = set(query) - set(OPTIONS)
    if unknown:
        raise ConfigError(f"remote_url {url!r}: unknown option(s) {sorted(unknown)}; known: {OPTIONS}")
    opt = {k: v[-1] for k, v in query.items()}
    try:
        staging_mib = int(opt.get("staging_mib", DEFAULT_STAGING_MIB))
    except ValueError:
        staging_mib = 0
    if not 1 <= staging_mib <= 65536:
        raise ConfigError(f"remote_url {url!r}: staging_mib must be an integer in [1, 65536]")
    host = parts.hostname
    return {"master": f"{host}:{port}", "host": host,
            "metadata": opt.get("metadata") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata",
            "local_host": opt.get("local_host") or "", "protocol": opt.get("protocol") or "tcp",
            "device": opt.get("device", ""), "staging_bytes": staging_mib << 20}


def check_url(url: str) -> None:
    parse_url(url)


def route_address(host: str) -> str:
    """The local address that routes to `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def record_key(page: PageAddress) -> str:
    return f"hc1:{page.salt.hex()}:{page.key.hex()}"


class MooncakeStore(RemoteStore):
    check_url = staticmethod(check_url)

    def __init__(self, url: str, *, password_file: str = "", timeout_s: float = 1.0) -> None:
        self.opts = parse_url(url)
        if password_file:
            raise ConfigError("remote_password_file: Mooncake Store has no credentials; "
                              "sign records with remote_secret_file instead")
        self.url = url
        self.timeout_s = timeout_s
        if not self.opts["local_host"]:
            self.opts["local_host"] = route_address(self.opts["host"])
        self.staging = Staging(self.opts["staging_bytes"])
        self._memfd = -1
        self._area: mmap.mmap | None = None
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._pending: dict[int, tuple[asyncio.Future, tuple[int, int] | None, asyncio.Semaphore]] = {}
        self._probe_slots: asyncio.Semaphore | None = None  # made on the worker's loop (connect)
        self._transfer_slots: asyncio.Semaphore | None = None
        self._next_id = 1
        self._failing_since = 0.0
        self.helper_starts = 0

    # -- the helper process --------------------------------------------------------
    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._writer is not None

    async def _spawn(self) -> None:
        await self._stop_helper()
        if self._memfd < 0:
            self._memfd = os.memfd_create("hicache-mooncake-staging", os.MFD_CLOEXEC)
            os.ftruncate(self._memfd, self.opts["staging_bytes"])
            self._area = mmap.mmap(self._memfd, self.opts["staging_bytes"])
        ours, theirs = socket.socketpair()
        o = self.opts
        args = [sys.executable, "-m", "hicache.tiers.remote.mooncake.helper", "--sock-fd", str(theirs.fileno()),
                "--staging-fd", str(self._memfd), "--staging-bytes", str(o["staging_bytes"]),
                "--master", o["master"], "--metadata", o["metadata"], "--local-host", o["local_host"],
                "--protocol", o["protocol"], "--device", o["device"], "--threads", str(HELPER_THREADS)]
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": o["local_host"],
               "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2")}
        try:
            self._proc = subprocess.Popen(args, pass_fds=(theirs.fileno(), self._memfd), env=env,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.helper_starts += 1
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._probe_slots, self._transfer_slots = asyncio.Semaphore(MAX_PROBES), asyncio.Semaphore(MAX_TRANSFERS)
        self._ready = asyncio.get_running_loop().create_future()
        self._reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader, self.helper_starts))

    async def _read_replies(self, reader: asyncio.StreamReader, generation: int) -> None:
        try:
            while True:
                head = await reader.readexactly(FRAME.size)
                rid, ok, result = msgpack.unpackb(await reader.readexactly(FRAME.unpack(head)[0]), raw=False)
                if rid == 0:
                    if self._ready is not None and not self._ready.done():
                        if ok:
                            self._ready.set_result(None)
                        else:
                            self._ready.set_exception(RemoteStoreError(f"mooncake helper: {result}"))
                    continue
                fut, extent, slots = self._pending.pop(rid, (None, None, None))
                if slots is not None:
                    slots.release()
                if fut is not None and fut.cancelled() and extent is not None:
                    self.staging.free(*extent)  # its caller is gone; a live caller frees its own
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(result)
                    else:
                        fut.set_exception(RemoteStoreError(f"mooncake: {result}"))
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            if generation == self.helper_starts:  # a replaced helper's reader must not touch the new one
                self._lost("the mooncake helper process exited")

    def _lost(self, why: str) -> None:
        """The helper is gone: fail every outstanding call, release the staging area."""
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RemoteStoreError(why))
        pending, self._pending = self._pending, {}
        for fut, extent, slots in pending.values():
            slots.release()
            if fut.cancelled() and extent is not None:
                self.staging.free(*extent)
            elif not fut.done():
                fut.set_exception(RemoteStoreError(why))
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _stop_helper(self) -> None:
        proc, self._proc = self._proc, None
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None
        self._lost("the mooncake helper was stopped")
        if proc is not None and proc.poll() is None:
            proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, proc.wait)

    async def _call(self, op: str, *args: Any, extent: tuple[int, int] | None = None,
                    then: Callable[[Any], Any] | None = None) -> Any:
        """One request to the helper; the caller's deadline cancels the wait, not the call.
        `extent` (staging space the call uses) is freed once the helper is done with it:
        here after `then(result)` (the copy out), or on the helper's late reply when the
        caller was cancelled. The slot goes back with the helper's reply."""
        try:
            if not self._usable():
                raise RemoteStoreError("not connected")
            slots = self._probe_slots if op in PROBE_OPS else self._transfer_slots
            assert slots is not None
            await slots.acquire()
        except BaseException:
            if extent is not None:
                self.staging.free(*extent)
            raise
        if not self._usable() or slots not in (self._probe_slots, self._transfer_slots):
            slots.release()  # the helper was lost (or replaced) while this call waited
            if extent is not None:
                self.staging.free(*extent)
            raise RemoteStoreError("not connected")
        rid, self._next_id = self._next_id, self._next_id + 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, extent, slots)
        assert self._writer is not None
        self._writer.write(frame([rid, op, *args]))
        try:
            result = await fut
            return then(result) if then is not None else result
        finally:
            if extent is not None and not fut.cancelled():
                self.staging.free(*extent)

    def _usable(self) -> bool:
        return (self._alive() and self._ready is not None and self._ready.done()
                and self._ready.exception() is None)

    # -- the interface ---------------------------------------------------------------
    async def connect(self) -> None:
        if self._usable():
            # a set-up client reconnects to a restarted master by itself; replace it only
            # when it has failed for long (a new one would block in setup() meanwhile)
            if not self._failing_since or time.monotonic() - self._failing_since < RESPAWN_AFTER_S:
                return
            log.warning("remote tier: the mooncake client failed for %.0fs; starting a new one",
                        time.monotonic() - self._failing_since)
            self._failing_since = 0.0
        if not self._alive() or self._ready is None or (self._ready.done() and self._ready.exception()):
            await self._spawn()
        assert self._ready is not None
        await asyncio.shield(self._ready)  # a set-up in progress survives the caller's deadline
        log.info("remote tier: mooncake client up (master %s, metadata %s, local %s)", self.opts["master"],
                 self.opts["metadata"], self.opts["local_host"])

    async def ping(self) -> None:
        try:
            codes = await self._call("exists", ["hc1:ping"])  # fails at once with the master down
            if codes[0] < 0:
                raise RemoteStoreError(f"mooncake: exists returned {codes[0]} (master unreachable?)")
        except BaseException:
            if not self._failing_since:
                self._failing_since = time.monotonic()
            raise
        self._failing_since = 0.0

    async def exists(self, pages: Sequence[PageAddress]) -> list[bool]:
        codes = await self._call("exists", [record_key(p) for p in pages])
        if codes and all(c < 0 for c in codes):
            raise RemoteStoreError(f"mooncake: exists returned {codes[0]}")
        return [c == 1 for c in codes]

    async def get(self, pages: Sequence[PageAddress], record_bytes: int = 0) -> list[bytes | None]:
        if record_bytes <= 0:
            raise RemoteStoreError("mooncake reads into preallocated buffers: the record size is needed")
        out: list[bytes | None] = []
        per_call = max(1, min(len(pages), self.staging.capacity // 2 // record_bytes))
        for i in range(0, len(pages), per_call):
            out += await self._get_chunk(pages[i:i + per_call], record_bytes)
        return out

    async def _get_chunk(self, pages: Sequence[PageAddress], record_bytes: int) -> list[bytes | None]:
        offset = await self.staging.alloc(record_bytes * len(pages))
        offsets = [offset + i * record_bytes for i in range(len(pages))]
        nbytes = record_bytes * len(pages)
        codes, blobs = await self._call("get", [record_key(p) for p in pages], offsets, [record_bytes] * len(pages),
                                        extent=(offset, nbytes),
                                        then=lambda codes: (codes, self._copy_out(offsets, codes)))
        failed = [c for c in codes if c < 0 and c != NOT_FOUND]
        if failed and len(failed) == len(codes):
            raise RemoteStoreError(f"mooncake: get returned {failed[0]}")
        return blobs  # a failed read (a dead storage process: -800) is a miss

    def _copy_out(self, offsets: list[int], sizes: list[int]) -> list[bytes | None]:
        assert self._area is not None
        return [self._area[o:o + n] if n > 0 else None for o, n in zip(offsets, sizes)]

    async def put(self, records: Sequence[tuple[PageAddress, memoryview]], ttl_s: float) -> int:
        stored = 0
        limit = self.staging.capacity // 2
        i = 0
        while i < len(records):
            j, nbytes = i, 0
            while j < len(records) and (j == i or nbytes + len(records[j][1]) <= limit):
                nbytes += len(records[j][1])
                j += 1
            try:
                stored += await self._put_chunk(records[i:j], nbytes)
            except PartialWrite as e:
                raise PartialWrite(stored + e.stored, e.cause) from None
            except Exception as e:
                if stored:
                    raise PartialWrite(stored, e) from None
                raise
            i = j
        return stored

    async def _put_chunk(self, records: Sequence[tuple[PageAddress, memoryview]], nbytes: int) -> int:
        if nbytes > self.staging.capacity:
            raise RemoteStoreError(f"a {nbytes}-byte record does not fit the {self.staging.capacity}-byte "
                                   "staging area (raise staging_mib)")
        offset = await self.staging.alloc(nbytes)
        assert self._area is not None
        offsets, at = [], offset
        for _, record in records:
            self._area[at:at + len(record)] = record
            offsets.append(at)
            at += len(record)
        codes = await self._call("put", [record_key(p) for p, _ in records], offsets, [len(r) for _, r in records],
                                 extent=(offset, nbytes))
        stored = sum(1 for c in codes if c == 0)
        failed = [c for c in codes if c != 0]
        if not failed:
            return stored
        # "OOM" tells the remote worker that a full store refuses writes but still serves reads
        cause = RemoteStoreError(("OOM: no segment has room" if failed[0] == NO_SPACE else "mooncake: put returned")
                                 + f" ({failed[0]})")
        if not stored:
            raise cause
        raise PartialWrite(stored, cause)

    async def delete_namespace(self, salt: bytes) -> int:
        n = await self._call("delete", f"^hc1:{salt.hex()}:")
        if n < 0:
            raise RemoteStoreError(f"mooncake: remove_by_regex returned {n}")
        return n

    async def close(self) -> None:
        await self._stop_helper()
        if self._area is not None:
            self._area.close()
            self._area = None
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1

    def describe(self) -> dict:
        return {"kind": "mooncake", "url": self.url, "mode": "helper process", "master": self.opts["master"],
                "metadata": self.opts["metadata"], "local_host": self.opts["local_host"],
                "staging_bytes": self.opts["staging_bytes"], "helper_starts": self.helper_starts,
                "password": "none", "ttl": "not enforced (the store evicts oldest first when 90% full)"}
