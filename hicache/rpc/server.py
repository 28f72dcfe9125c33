"""The daemon's side of the socket: one asyncio Protocol per connection.

Handlers are plain callables `handler(conn, params) -> result`; a handler may
return an awaitable, which then runs as a tracked task. Synchronous handlers
(match, insert, ... : pure index work) answer inline with no task at all, which
keeps a round trip close to a bare echo. Nothing a client sends can crash the
daemon: bad frames get an error response, and only broken framing (an
oversized or undecodable length prefix) closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hicache.errors import ProtocolError
from hicache.rpc.framing import FrameDecoder, pack_frame, unpack_body
from hicache.rpc.protocol import Code, RpcError

log = logging.getLogger(__name__)

Handler = Callable[["Connection", dict], Any]


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass(slots=True)
class WithFds:
    """A result to send together with file descriptors (SCM_RIGHTS)."""

    result: Any
    fds: list[int]


def peer_credentials(fd: int) -> PeerCred:
    with socket.socket(fileno=os.dup(fd)) as s:
        raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCred(*struct.unpack("3i", raw))


def _supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class Connection(asyncio.Protocol):
    def __init__(self, server: RpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: PeerCred | None = None
        self.decoder = FrameDecoder(server.max_frame_bytes)
        self.inflight: set[asyncio.Task] = set()
        self.closed = False
        self.subscribed = False
        self.state: dict[str, Any] = {}  # per-connection data owned by the daemon (engines, pins)
        self._fd = -1
        self._reading_paused = False

    # -- asyncio callbacks ------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        try:
            self.peer = peer_credentials(self._fd)
        except OSError:
            self.peer = None
        if not self.server.allowed(self.peer):
            log.warning("refusing connection from %s: not an allowed uid/gid", self.peer)
            transport.close()
            self.closed = True
            return
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            bodies = self.decoder.feed(data)
        except ProtocolError as e:
            log.warning("closing connection from %s: %s", self.peer, e)
            self._abort()
            return
        for body in bodies:
            self._handle(body)
        if self.decoder.buffered > self.server.max_buffer_bytes:
            log.warning("closing connection from %s: %d bytes buffered", self.peer, self.decoder.buffered)
            self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for task in self.inflight:
            task.cancel()
        try:
            self.server.on_disconnect(self)
        except Exception:
            log.exception("disconnect cleanup failed")

    # Back-pressure: a client that does not read its responses stops being read.
    def pause_writing(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- requests ---------------------------------------------------------
    def _handle(self, body: bytes) -> None:
        try:
            msg = unpack_body(body)
        except ProtocolError as e:
            self.send_error(None, Code.BAD_REQUEST, str(e))
            return
        req_id = msg.get("id")
        method = msg.get("method")
        params = msg.get("params", {})
        if not isinstance(req_id, int) or isinstance(req_id, bool):
            self.send_error(None, Code.BAD_REQUEST, "request id must be an int")
            return
        if not isinstance(method, str) or not isinstance(params, dict):
            self.send_error(req_id, Code.BAD_REQUEST, "method must be a string and params a map")
            return
        handler = self.server.handlers.get(method)
        if handler is None:
            self.send_error(req_id, Code.UNKNOWN_METHOD, f"unknown method {method!r}")
            return
        if self.server.draining and method not in self.server.allowed_while_draining:
            self.send_error(req_id, Code.SHUTTING_DOWN, "the daemon is shutting down")
            return
        if len(self.inflight) >= self.server.max_inflight:
            self.send_error(req_id, Code.BUSY, f"more than {self.server.max_inflight} requests in flight")
            return
        t0 = time.perf_counter()
        try:
            result = handler(self, params)
        except RpcError as e:
            self.send_error(req_id, e.code, e.message)
            self._observe(method, t0, e.code.value)
            return
        except Exception as e:
            log.exception("handler %s failed", method)
            self.send_error(req_id, Code.INTERNAL, f"{type(e).__name__}: {e}")
            self._observe(method, t0, Code.INTERNAL.value)
            return
        if asyncio.iscoroutine(result):  # async handlers; cheaper than an Awaitable ABC check
            task = asyncio.ensure_future(self._finish(req_id, method, result, t0))
            self.inflight.add(task)
            self.server.tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            self.send_result(req_id, result)
            self._observe(method, t0, "OK")

    async def _finish(self, req_id: int, method: str, aw: Awaitable, t0: float) -> None:
        try:
            result = await aw
        except RpcError as e:
            self.send_error(req_id, e.code, e.message)
            self._observe(method, t0, e.code.value)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("handler %s failed", method)
            self.send_error(req_id, Code.INTERNAL, f"{type(e).__name__}: {e}")
            self._observe(method, t0, Code.INTERNAL.value)
        else:
            self.send_result(req_id, result)
            self._observe(method, t0, "OK")

    def _observe(self, method: str, t0: float, code: str) -> None:
        if self.server.observe is not None:
            self.server.observe(method, time.perf_counter() - t0, code)

    def _task_done(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        self.server.tasks.discard(task)

    # -- output -------------------------------------------------------------
    def send_result(self, req_id: int, result: Any) -> None:
        if isinstance(result, WithFds):
            self._send_with_fds({"id": req_id, "result": result.result}, result.fds)
        else:
            self.send({"id": req_id, "result": result})

    def send_error(self, req_id: int | None, code: Code, message: str) -> None:
        self.send({"id": req_id, "error": {"code": code.value, "message": message}})

    def send(self, msg: dict) -> None:
        if self.closed or self.transport is None:
            return
        self.transport.write(pack_frame(msg))

    def _send_with_fds(self, msg: dict, fds: list[int]) -> None:
        """SCM_RIGHTS needs sendmsg, which transports do not offer; write the
        frame on the raw fd while the transport has nothing queued (the
        handshake is the first exchange, so this holds)."""
        if self.closed or self.transport is None:
            return
        frame = pack_frame(msg)
        if self.transport.get_write_buffer_size() != 0:
            self.send_error(msg["id"], Code.BUSY, "cannot pass descriptors with output queued; retry hello")
            return
        with socket.socket(fileno=os.dup(self._fd)) as s:
            s.setblocking(True)
            sent = s.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
            if sent < len(frame):
                s.sendall(frame[sent:])

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class RpcServer:
    """Accepts connections on a Unix socket and dispatches frames to handlers."""

    def __init__(self, handlers: dict[str, Handler], *, max_frame_bytes: int, max_buffer_bytes: int,
                 max_inflight: int, allowed_uids: set[int], allowed_gids: set[int],
                 on_disconnect: Callable[[Connection], None]) -> None:
        self.handlers = handlers
        self.max_frame_bytes = max_frame_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.max_inflight = max_inflight
        self.allowed_uids = allowed_uids
        self.allowed_gids = allowed_gids
        self.on_disconnect = on_disconnect
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.draining = False
        self.allowed_while_draining = {"release", "load_done", "backup_done", "stats"}
        self.observe: Callable[[str, float, str], None] | None = None  # (method, seconds, code), for metrics
        self._server: asyncio.AbstractServer | None = None

    def allowed(self, peer: PeerCred | None) -> bool:
        if peer is None:
            return False
        if peer.uid in self.allowed_uids or peer.gid in self.allowed_gids:
            return True
        # SO_PEERCRED carries the primary group only; members of an allowed group by
        # supplementary membership are found in /proc (where the daemon may look).
        return bool(self.allowed_gids) and not self.allowed_gids.isdisjoint(_supplementary_groups(peer.pid))

    async def start(self, path: str | None = None, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_unix_server(lambda: Connection(self), sock=sock)
        else:
            assert path is not None
            # Create with 0660 from the start: no window where others could connect.
            old = os.umask(0o117)
            try:
                self._server = await loop.create_unix_server(lambda: Connection(self), path=path)
            finally:
                os.umask(old)
            os.chmod(path, 0o660)

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, answer what is in flight (up to timeout_s), then close."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)

    def broadcast_event(self, event: dict) -> None:
        msg = {"event": event}
        for conn in self.connections:
            if conn.subscribed:
                conn.send(msg)
