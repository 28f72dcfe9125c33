"""The daemon's side of the socket: the listener, its frame loop, and the limits over all connections.

`RpcServer` (here) accepts, sheds input over the global cap, drains and broadcasts events;
each peer's dispatch, checks and limits are its `Connection`'s (connection.py). Two frame
loops serve the connections, one per server. Where the C extension builds
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

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Collection
from typing import Any

from hicache.rpc import native_conn
from hicache.rpc.connection import Connection, Handler, ServerCounters
from hicache.rpc.framing import new_packer, pack_frame
from hicache.rpc.peers import PeerCred, member

log = logging.getLogger(__name__)


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
        self._server: asyncio.AbstractServer | native_conn.NativeListener | None = None

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
