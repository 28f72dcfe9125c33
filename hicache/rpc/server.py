"""The daemon's side of the socket: dispatch, checks and limits per connection.

Two frame loops serve the connections, one per server. Where the C extension builds
(hicache/rpc/native_conn.py), each connection's reading, frame splitting and writing
run in C as its event loop reader callback, which calls `Connection._handle` once per
whole frame; otherwise, or with HICACHE_NATIVE_RPC=0 or `native=False`, `Connection`
is an asyncio Protocol. Both keep every guarantee below; `frame_loop` says which serves.
On the C loop, a handler may carry a `fast` twin (`RpcServer.fast_handler`) that answers
the common well-formed request without the request and reply dicts (native_conn.py).

Handlers are plain callables `handler(conn, params) -> result`; an `async def`
handler's coroutine runs as a tracked task. Synchronous handlers
(match, insert, ... : pure index work) answer inline with no task at all, which
keeps a round trip close to a bare echo. Nothing a client sends can crash the
daemon: bad frames get an error response, and only broken framing (an
oversized or undecodable length prefix) closes the connection.

Nothing a client does can stall the loop or grow memory without bound:
- every write is non-blocking (the descriptor-passing one too); a connection
  whose unsent output passes `max_output_bytes` is aborted, never waited on,
  and one whose output passes the high-water mark stops being read and served
  until it reads;
- a connection handles at most FRAMES_PER_TURN frames, or TURN_S seconds of them,
  per loop turn, then the rest on a later turn, not reading meanwhile;
- unparsed input is capped per connection (`max_buffer_bytes`) and over all of
  them (`max_total_buffer_bytes`: the connection holding the most goes first);
- an event subscriber whose unsent output passes `max_event_backlog_bytes` is
  dropped (its connection closed: a router notices and resubscribes).

Roles: a connection must `hello` before anything else (HELLO_REQUIRED), and
the methods in `admin_methods` need an admin peer (root, the daemon's uid, or
a member of an admin group), checked here before any handler runs (FORBIDDEN).
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import time
from types import CoroutineType
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.errors import ProtocolError
from hicache.rpc.framing import HEADER, FrameDecoder, new_packer, pack_frame, unpack_body
from hicache.rpc.peers import PeerCred, member, peer_credentials, unread_bytes
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.rpc.native_conn import NativeListener

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


class Connection(asyncio.Protocol):
    def __init__(self, server: RpcServer) -> None:
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


class RpcServer:
    """Accepts connections on a Unix socket and dispatches frames to handlers."""

    def __init__(self, handlers: dict[str, Handler], *, max_frame_bytes: int, max_buffer_bytes: int,
                 max_inflight: int, allowed_uids: set[int], allowed_gids: set[int],
                 on_disconnect: Callable[[Connection], None], admin_uids: Collection[int] = (),
                 admin_gids: Collection[int] = (), admin_methods: Collection[str] = (),
                 max_total_buffer_bytes: int | None = None, max_output_bytes: int | None = None,
                 max_event_backlog_bytes: int | None = None, hello_method: str = "hello",
                 native: bool | None = None) -> None:
        self.handlers = handlers
        self.max_frame_bytes = max_frame_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.max_total_buffer_bytes = max_total_buffer_bytes or 4 * max_buffer_bytes
        self.max_output_bytes = max_output_bytes or 2 * max_frame_bytes
        self.max_event_backlog_bytes = max_event_backlog_bytes or 8 << 20
        self.max_inflight = max_inflight
        self.allowed_uids = allowed_uids
        self.allowed_gids = allowed_gids
        self.admin_uids = frozenset(admin_uids) or frozenset({0, os.getuid()})
        self.admin_gids = frozenset(admin_gids)
        self.admin_methods = frozenset(admin_methods)
        self.hello_method = hello_method
        self.on_disconnect = on_disconnect
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.buffered_bytes = 0  # unparsed input over all connections
        self.counters = ServerCounters()
        self.packer = new_packer()  # the loop's thread only
        self.draining = False
        self.allowed_while_draining = {"release", "load_done", "backup_done", "stats", "sync"}
        self.observe: Callable[[str, float, str], None] | None = None  # (method, seconds, code), for metrics
        self.native = native  # the C frame loop: None = where it builds (HICACHE_NATIVE_RPC=0: never)
        self.frame_loop = ""  # which served the connections once started: "native" or "asyncio"
        self._server: asyncio.AbstractServer | NativeListener | None = None

    def fast_handler(self, method: str) -> Callable[[Connection, int, bytes | None], Any] | None:
        """The native frame loop's shortcut for `method` (hicache/rpc/native_conn.py): the
        `fast` attribute its handler carries, `fast(conn, arg, keys)` -> a result C encodes,
        or None to decline (nothing changed: the frame takes the general path). Never for
        an admin method (its role check stays `_handle`'s)."""
        if method in self.admin_methods:
            return None
        return getattr(self.handlers.get(method), "fast", None)

    def allowed(self, peer: PeerCred | None) -> bool:
        return member(peer, self.allowed_uids, self.allowed_gids)

    def is_admin(self, peer: PeerCred | None) -> bool:
        return member(peer, self.admin_uids, self.admin_gids)

    def shed_input(self) -> None:
        """Over the global input cap, close the connections holding the most until under it:
        half-sent frames on many connections cannot add up without bound."""
        while self.buffered_bytes > self.max_total_buffer_bytes and self.connections:
            victim = max(self.connections, key=lambda c: c._buffered)
            log.warning("closing connection from %s: it buffers %d bytes and all connections %d (cap %d)",
                        victim.peer, victim._buffered, self.buffered_bytes, self.max_total_buffer_bytes)
            self.counters.input_overflows += 1
            victim._abort()
            self.connections.discard(victim)

    async def start(self, path: str | None = None, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        # Imported here: native_conn builds on this module's Connection.
        from hicache.rpc import native_conn
        mod = native_conn.load() if self.native is not False else None
        if self.native and mod is None:
            raise RuntimeError(f"native frame loop {native_conn.unavailable_reason()}")
        if mod is not None:
            self.frame_loop = "native"
            sock = sock if sock is not None else native_conn.listen_unix(path)  # type: ignore[arg-type]
            self._server = native_conn.NativeListener(self, loop, sock, mod)
            return
        self.frame_loop = "asyncio"
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
            conn.close()
        await asyncio.sleep(0)
        for conn in list(self.connections):  # a peer that does not read must not hold the exit
            if conn.output_bytes:
                conn._abort()

    def broadcast_event(self, event: dict, namespace: str | None = None) -> None:
        """To subscribers that may see the namespace (admins: all); drops those behind."""
        frame: bytes | None = None
        for conn in list(self.connections):
            if not conn.subscribed or conn.closed or (not conn.admin and namespace not in conn.namespaces):
                continue
            if conn.output_bytes > self.max_event_backlog_bytes:
                log.warning("dropping event subscriber %s: %d bytes of events unread (cap %d)",
                            conn.peer, conn.output_bytes, self.max_event_backlog_bytes)
                self.counters.dropped_subscribers += 1
                conn._abort()
                continue
            if frame is None:
                frame = pack_frame({"event": event}, self.packer)
            conn.write_frame(frame)
