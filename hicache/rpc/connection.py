"""A daemon connection: one peer's frames in, replies and events out, within per-connection limits.

`Connection` is the asyncio Protocol the server's asyncio frame loop serves, and the base of the
native loop's connections (native_conn.py); `RpcServer` (server.py) owns them. A connection sees
its server only through `ConnectionOwner`, so this module imports neither of the other two.
The guarantees (writes never block, turns are bounded, input and output are capped) are listed
in server.py's docstring.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from types import CoroutineType
from typing import Any, Protocol

import msgpack

from hicache.errors import ProtocolError
from hicache.rpc.framing import HEADER, FrameDecoder, pack_frame, unpack_body
from hicache.rpc.peers import PeerCred, peer_credentials, unread_bytes
from hicache.rpc.protocol import Code, RpcError

log = logging.getLogger(__name__)

Handler = Callable[["Connection", dict], Any]

FRAMES_PER_TURN = 64  # frames one connection handles per loop turn before others get theirs
TURN_S = 0.002  # and their time (a step's 32 put_done took 20-45 ms on a loaded machine)
HIGH_WATER_BYTES = 64 << 10  # unsent output that pauses serving a connection (asyncio's default)


@dataclass(slots=True)
class ServerCounters:
    requests: int = 0  # frames handled
    fast_requests: int = 0  # of which the native frame loop's fast path answered (native_conn.py)
    dropped_subscribers: int = 0  # subscribers that fell behind, closed
    output_overflows: int = 0  # connections aborted over max_output_bytes
    input_overflows: int = 0  # connections closed over max_buffer_bytes / max_total_buffer_bytes


@dataclass(slots=True)
class WithFds:
    """A result to send together with file descriptors (SCM_RIGHTS)."""

    result: Any
    fds: list[int]


class ConnectionOwner(Protocol):
    """What a connection reads and updates of its server (RpcServer is the one)."""

    handlers: dict[str, Handler]
    max_frame_bytes: int
    max_buffer_bytes: int
    max_output_bytes: int
    max_inflight: int
    admin_methods: frozenset[str]
    hello_method: str
    on_disconnect: Callable[[Connection], None]
    connections: set[Connection]
    tasks: set[asyncio.Task]
    buffered_bytes: int  # unparsed input over all connections
    counters: ServerCounters
    packer: msgpack.Packer
    draining: bool
    allowed_while_draining: Collection[str]
    observe: Callable[[str, float, str], None] | None

    def fast_handler(self, method: str) -> Callable[[Connection, int, bytes | None], Any] | None: ...

    def allowed(self, peer: PeerCred | None) -> bool: ...

    def is_admin(self, peer: PeerCred | None) -> bool: ...

    def shed_input(self) -> None: ...


class Connection(asyncio.Protocol):
    def __init__(self, server: ConnectionOwner) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: PeerCred | None = None
        self.decoder = FrameDecoder(server.max_frame_bytes)
        self.inflight: set[asyncio.Task] = set()
        self.closed = False
        self.subscribed = False
        self.greeted = False  # a hello succeeded
        self.admin = False  # the peer may call admin methods and see every namespace
        self.namespaces: set[str] = set()  # salts (hex) this connection registered: what it may see
        self.state: dict[str, Any] = {}  # per-connection data owned by the daemon (engines, pins)
        self._fd = -1
        self._buffered = 0  # this connection's share of server.buffered_bytes
        self._output_paused = False  # unsent output over the high-water mark
        self._reading_paused = False
        self._turn: asyncio.Handle | None = None  # frames left for a later loop turn

    # -- asyncio callbacks ------------------------------------------------
    def _admit(self) -> bool:
        """The peer's credentials and role; False (logged) for a peer the server does not allow."""
        try:
            self.peer = peer_credentials(self._fd)
        except OSError:
            self.peer = None
        if not self.server.allowed(self.peer):
            log.warning("refusing connection from %s: not an allowed uid/gid", self.peer)
            return False
        self.admin = self.server.is_admin(self.peer)
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        if not self._admit():
            transport.close()
            self.closed = True
            return
        self.transport.set_write_buffer_limits(high=min(HIGH_WATER_BYTES, self.server.max_output_bytes // 2))
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if (not self.decoder.buffered and self._turn is None and not self._output_paused
                and len(data) > 4 and HEADER.unpack_from(data)[0] == len(data) - 4
                and len(data) - 4 <= self.decoder.max_frame_bytes):
            # One whole frame and nothing buffered (a blocking client's request): handled
            # straight from the read, without copying it through the decoder's buffer.
            self._handle(memoryview(data)[4:])
            return
        self.decoder.append(data)
        if self._turn is None and not self._output_paused:
            self._run_frames()
        else:
            self._account()
        if self.closed:
            return
        if self.decoder.buffered > self.server.max_buffer_bytes:
            log.warning("closing connection from %s: %d bytes buffered", self.peer, self.decoder.buffered)
            self.server.counters.input_overflows += 1
            self._abort()
            return
        self.server.shed_input()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._forget_input()
        self.server.connections.discard(self)
        for task in self.inflight:
            task.cancel()
        try:
            self.server.on_disconnect(self)
        except Exception:
            log.exception("disconnect cleanup failed")

    # Back-pressure: a client that does not read its responses stops being read and served.
    def pause_writing(self) -> None:
        self._output_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._output_paused = False
        if self._turn is None and not self.closed:
            self._turn = asyncio.get_running_loop().call_soon(self._run_frames)
        self._update_reading()

    # -- input --------------------------------------------------------------
    def _run_frames(self) -> None:
        """Handle up to FRAMES_PER_TURN buffered frames, for up to TURN_S; the rest wait for a later
        loop turn (reading paused meanwhile): one connection's burst cannot hold the loop."""
        self._turn = None
        end = time.perf_counter() + TURN_S
        for i in range(FRAMES_PER_TURN + 1):
            if self.closed or self._output_paused:
                break
            if i == FRAMES_PER_TURN or (i and time.perf_counter() >= end):  # the rest on a later turn
                self._turn = asyncio.get_running_loop().call_soon(self._run_frames)
                break
            try:
                body = self.decoder.next_frame()
            except ProtocolError as e:
                log.warning("closing connection from %s: %s", self.peer, e)
                self._abort()
                return
            if body is None:
                break
            self._handle(body)
        self._account()
        self._update_reading()

    def _update_reading(self) -> None:
        paused = self._output_paused or self._turn is not None
        if paused == self._reading_paused or self.closed or self.transport is None:
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _account(self) -> None:
        now = self.decoder.buffered
        self.server.buffered_bytes += now - self._buffered
        self._buffered = now

    def _forget_input(self) -> None:
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        self.server.buffered_bytes -= self._buffered
        self._buffered = 0
        self.decoder = FrameDecoder(self.server.max_frame_bytes)  # drop what was buffered

    # -- requests ---------------------------------------------------------
    def _handle(self, body: bytes | memoryview) -> None:
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
        quiet = msg.get("noreply") is True  # answered only when it fails (see protocol.py)
        server = self.server
        server.counters.requests += 1
        if not self.greeted and method != server.hello_method:
            self.send_error(req_id, Code.HELLO_REQUIRED, f"send {server.hello_method!r} first")
            return
        handler = server.handlers.get(method)
        if handler is None:
            self.send_error(req_id, Code.UNKNOWN_METHOD, f"unknown method {method!r}")
            return
        if method in server.admin_methods and not self.admin:
            self.send_error(req_id, Code.FORBIDDEN, f"{method} needs an admin peer (root, the daemon's user "
                                                    "or a member of an admin group)")
            return
        if server.draining and method not in server.allowed_while_draining:
            self.send_error(req_id, Code.SHUTTING_DOWN, "the daemon is shutting down")
            return
        if len(self.inflight) >= server.max_inflight:
            self.send_error(req_id, Code.BUSY, f"more than {server.max_inflight} requests in flight")
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
        if type(result) is CoroutineType:  # async handlers (`async def`); no ABC check for the rest
            task = asyncio.ensure_future(self._finish(req_id, method, result, t0, quiet))
            self.inflight.add(task)
            server.tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            if method == server.hello_method:
                self.greeted = True
            if not quiet:
                self.send_result(req_id, result)
            if server.observe is not None:
                server.observe(method, time.perf_counter() - t0, "OK")

    async def _finish(self, req_id: int, method: str, aw: Awaitable, t0: float, quiet: bool) -> None:
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
            self._succeeded(method)
            if not quiet:
                self.send_result(req_id, result)
            self._observe(method, t0, "OK")

    def _succeeded(self, method: str) -> None:
        if method == self.server.hello_method:
            self.greeted = True

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
        self.write_frame(pack_frame(msg, self.server.packer))

    def write_frame(self, frame: bytes) -> None:
        """Queue bytes on the transport (never blocks); over max_output_bytes unsent, abort."""
        assert self.transport is not None
        self.transport.write(frame)
        pending = self.transport.get_write_buffer_size()
        if pending > self.server.max_output_bytes:
            log.warning("aborting connection from %s: %d bytes of output unread (cap %d)",
                        self.peer, pending, self.server.max_output_bytes)
            self.server.counters.output_overflows += 1
            self._abort()

    @property
    def output_bytes(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None and not self.closed else 0

    def _send_with_fds(self, msg: dict, fds: list[int]) -> None:
        """SCM_RIGHTS needs sendmsg, which transports do not offer: send on a dup of the
        socket while the transport has nothing queued (so order holds), without ever
        blocking. The dup shares the open file, so setblocking(True) on it would make the
        transport's socket blocking too and freeze the loop on a client that does not read."""
        if self.closed:
            return
        if self.output_bytes or unread_bytes(self._fd):
            # Also while the peer has not read what the kernel holds for it: so at most one
            # message of descriptors is ever in flight per connection, and a client that asks
            # again and again without reading cannot pile up descriptors in flight (which
            # count against the daemon's user and would make passing fail for everyone).
            self.send_error(msg["id"], Code.BUSY, "cannot pass descriptors with replies unread; read them "
                                                  "and retry")
            return
        frame = pack_frame(msg, self.server.packer)
        try:
            with socket.socket(fileno=os.dup(self._fd)) as s:
                s.setblocking(False)  # already so (shared with the transport); said again, not assumed
                sent = s.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except (BlockingIOError, InterruptedError):  # the socket is full and nothing went
            self.send_error(msg["id"], Code.BUSY, "the connection is full; read its replies and retry")
            return
        except OSError as e:
            log.warning("closing connection from %s: cannot pass descriptors: %s", self.peer, e)
            self._abort()
            return
        if sent < len(frame):  # the descriptors went with the first byte; the transport sends the rest
            self.write_frame(frame[sent:])

    def close(self) -> None:
        """Stop reading, send what is queued, then close."""
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self.closed = True
        self._forget_input()
        if self.transport is not None:
            self.transport.abort()
