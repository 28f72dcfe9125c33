"""The daemon's connections served by a native (C) frame loop.

Each accepted connection gets a C `NativeConn` (hicache/rpc/native_conn.c) as
its event loop reader callback: it receives, splits frames and sends in C, and calls
the same Python dispatch as the asyncio path (`Connection._handle`) once per whole
frame, on the loop's thread. A blocking client's round trip then runs no Python but the
dispatch and its handler: no asyncio transport, no Python frame decoder, one send per
turn for every reply the turn queued.

The guarantees of hicache/rpc/server.py hold unchanged; C only reports, Python decides:
- C calls back only when a turn leaves something to do (`_turn_end`: frames left past
  FRAMES_PER_TURN, output the socket refused, partial-frame bytes that changed, which
  the input caps count) or the stream ends or breaks (`_closed`);
- output the socket refuses is watched with a writer callback; past the high-water mark
  the connection is neither read nor served until it drains to a quarter of it, past
  `max_output_bytes` it is aborted;
- replies with descriptors (WithFds) go out through Python's sendmsg once what C queued
  is sent (server.py), as on the asyncio path.
A teardown (abort, end of stream, a failed send) stops watching the descriptor before C
closes it, once, and runs `connection_lost` on a later loop turn, never under a handler.

The fast path: `match` and `release` frames of the shape the client sends are parsed in C
(native_fast_parse.c) and go to `_fast`, which makes `_handle`'s checks (hello, draining,
requests in flight) and calls the method's fast handler (`handler.fast`, see
`RpcServer.fast_handler`: the daemon's in hicache/daemon/serve/handlers.py); C encodes its
answer, byte for byte the packer's. What a check refuses or the handler declines (before
changing anything) and every other frame go to `_handle` unchanged, so errors, their order
and the counters and metrics (`requests`, `observe`) are the Python path's.

The extension `hicache.rpc._native_conn` is compiled by the build (setup.py; the C:
native_conn.c, native_frames.h, native_fast_parse.c, native_fast_reply.c). Where it was not
built, or with HICACHE_NATIVE_RPC=0, `load()` returns None and the server keeps the
asyncio Protocol path (server.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import time
from types import ModuleType
from typing import Any

from hicache.kernels import native_build
from hicache.rpc.protocol import Code
from hicache.rpc.connection import FRAMES_PER_TURN, HIGH_WATER_BYTES, TURN_S, Connection, ConnectionOwner

log = logging.getLogger(__name__)

ACCEPTS_PER_TURN = 64  # connections accepted per loop turn (the rest on the next)
ACCEPT_RETRY_S = 1.0  # after running out of descriptors, accepting pauses this long (as asyncio)

EXTENSION = native_build.NativeModule("hicache.rpc._native_conn", "HICACHE_NATIVE_RPC",
                                      "serving connections with asyncio")
load = EXTENSION.load  # the compiled extension, or None where it was not built
unavailable_reason = EXTENSION.unavailable_reason


class NativeConnection(Connection):
    """A Connection whose socket is read, split and written by C (no asyncio transport)."""

    def __init__(self, server: ConnectionOwner, loop: asyncio.AbstractEventLoop, fd: int, mod: ModuleType) -> None:
        super().__init__(server)
        self._loop = loop
        self._fd = fd
        self._high = min(HIGH_WATER_BYTES, server.max_output_bytes // 2)
        self._low = self._high // 4
        self._oversized = mod.CLOSED_OVERSIZED
        self._native = mod.NativeConn(fd, self._handle, self._turn_end, self._closed, server.max_frame_bytes,
                                      FRAMES_PER_TURN, self._high, turn_s=TURN_S)
        # match and release frames of the client's shape, answered by C around one Python call
        self._fast_handlers = {kind: (m, server.fast_handler(m))
                               for kind, m in ((mod.FAST_MATCH, "match"), (mod.FAST_RELEASE, "release"))}
        if any(h for _, h in self._fast_handlers.values()):
            self._native.fast = self._fast
        self._reading = False
        self._writing = False
        self._closing = False  # closing gracefully: sending what is queued first
        self._torn_down = False

    def start(self) -> None:
        if not self._admit():
            self._abort()
            return
        self.server.connections.add(self)
        self._update_reading()

    # -- the fast path (native_fast_parse.c) -------------------------------
    def _fast(self, kind: int, req_id: int, arg: int, keys: bytes | None) -> Any:
        """A match or release frame C parsed: its method's fast handler, behind the checks
        `_handle` makes. None sends the frame to `_handle` (what a check refuses, or the
        handler declines before changing anything, gets its answer there); False: answered
        here (an error); else the result, which C encodes as `send_result` would."""
        server = self.server
        method, handler = self._fast_handlers[kind]
        if (handler is None or not self.greeted or len(self.inflight) >= server.max_inflight
                or (server.draining and method not in server.allowed_while_draining)):
            return None
        t0 = time.perf_counter()
        try:
            result = handler(self, arg, keys)
        except Exception as e:  # a bug: the daemon's fast handlers decline what they refuse
            log.exception("fast handler %s failed", method)
            server.counters.requests += 1
            self.send_error(req_id, Code.INTERNAL, f"{type(e).__name__}: {e}")
            self._observe(method, t0, Code.INTERNAL.value)
            return False
        if result is not None:
            counters = server.counters
            counters.requests += 1
            counters.fast_requests += 1
            if server.observe is not None:
                server.observe(method, time.perf_counter() - t0, "OK")
        return result

    # -- reports from C -----------------------------------------------------
    def _turn_end(self, more: int, pending: int, buffered: int) -> None:
        if pending:
            self._output(pending)
        if self.closed:
            return
        self.server.buffered_bytes += buffered - self._buffered
        self._buffered = buffered
        if buffered > self.server.max_buffer_bytes:
            log.warning("closing connection from %s: %d bytes buffered", self.peer, buffered)
            self.server.counters.input_overflows += 1
            self._abort()
            return
        if more and self._turn is None:  # FRAMES_PER_TURN or TURN_S used up: the rest on a later turn
            self._turn = self._loop.call_soon(self._next_turn)
        self._update_reading()
        self.server.shed_input()

    def _closed(self, reason: int, value: int) -> None:
        if reason == self._oversized:
            log.warning("closing connection from %s: frame of %d bytes exceeds the cap of %d", self.peer, value,
                        self.server.max_frame_bytes)
            self._abort()
        else:  # end of stream (value 0) or a receive error (its errno)
            if value:
                log.debug("connection from %s lost: %s", self.peer, os.strerror(value))
            self.close()

    def _next_turn(self) -> None:
        self._turn = None
        if not self.closed:
            self._native.run()
            self._update_reading()

    def _on_writable(self) -> None:
        pending = self._native.flush()
        if pending < 0:
            self._abort()
            return
        if pending == 0 and self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if self._output_paused and pending <= self._low:  # drained enough: serve again
            self._output_paused = False
            self._native.paused = self._closing
            if self._turn is None:
                self._turn = self._loop.call_soon(self._next_turn)
            self._update_reading()
        if self._closing and pending == 0:
            self._teardown()

    def _update_reading(self) -> None:
        want = not (self.closed or self._closing or self._output_paused or self._turn is not None)
        if want != self._reading:
            self._reading = want
            if want:
                self._loop.add_reader(self._fd, self._native)
            else:
                self._loop.remove_reader(self._fd)

    # -- output -------------------------------------------------------------
    def send(self, msg: dict) -> None:
        if not self.closed:
            pending = self._native.send_body(self.server.packer.pack(msg))
            if pending:
                self._output(pending)

    def write_frame(self, frame: bytes) -> None:
        pending = self._native.write(frame)
        if pending:
            self._output(pending)

    def _output(self, pending: int) -> None:
        """The socket refused `pending` bytes (-1: the peer is gone): watch for room, pause
        over the high-water mark, abort over max_output_bytes."""
        if pending < 0:
            self._abort()
            return
        if pending > self.server.max_output_bytes:
            log.warning("aborting connection from %s: %d bytes of output unread (cap %d)",
                        self.peer, pending, self.server.max_output_bytes)
            self.server.counters.output_overflows += 1
            self._abort()
            return
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)
        if pending > self._high and not self._output_paused:
            self._output_paused = True
            self._native.paused = True
            self._update_reading()

    @property
    def output_bytes(self) -> int:
        return 0 if self.closed else self._native.pending

    def _send_with_fds(self, msg: dict, fds: list[int]) -> None:
        if not self.closed:
            self._native.flush()  # replies queued earlier in this turn go first
        super()._send_with_fds(msg, fds)

    # -- teardown -------------------------------------------------------------
    def close(self) -> None:
        """Stop reading and serving, send what is queued, then close."""
        if self.closed or self._closing:
            return
        self._closing = True
        self._native.paused = True
        self._update_reading()
        if self._native.flush() <= 0:
            self._teardown()
        elif not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)

    def _abort(self) -> None:
        self.closed = True
        self._teardown()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self.closed = True
        self._forget_input()  # now: the total input cap counts this connection out at once
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        self._native.close()  # closes the descriptor, once
        self._loop.call_soon(self.connection_lost, None)


class NativeListener:
    """Accepts on a listening Unix socket (in Python: rare) and serves each connection
    with a NativeConnection."""

    def __init__(self, server: ConnectionOwner, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 mod: ModuleType) -> None:
        self._server, self._loop, self._sock, self._mod = server, loop, sock, mod
        sock.setblocking(False)
        self._retry: asyncio.TimerHandle | None = None
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # out of descriptors or memory: retry later, not in a busy loop
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                log.error("cannot accept connections: %s; retrying in %.0f s", e, ACCEPT_RETRY_S)
                self._loop.remove_reader(self._sock.fileno())
                self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            sock.setblocking(False)
            NativeConnection(self._server, self._loop, sock.detach(), self._mod).start()

    def _resume(self) -> None:
        self._retry = None
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        elif self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


def listen_unix(path: str) -> socket.socket:
    """A listening socket at `path`, created 0660 (no window where others could connect);
    a stale socket file there is replaced, as asyncio's create_unix_server does."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.remove(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    sock.listen(100)
    return sock
