"""A bare wire client for the fault-and-abuse suite: frames on a raw Unix socket.

The real clients hide exactly what these tests need to see (every reply, every
descriptor that arrives with one, a daemon that stops answering), so this one
does nothing clever: it writes bytes, reads frames with `recvmsg`, and keeps a
deadline on every wait. Every connection sends `hello` first, as the daemon requires.
"""

from __future__ import annotations

import array
import os
import selectors
import socket
import struct
import time
from typing import Any

import msgpack

from hicache.rpc.protocol import PROTOCOL_VERSION

HEADER = struct.Struct(">I")
MAX_REPLY_BYTES = 256 << 20


class WireError(AssertionError):
    """The daemon did not answer as a daemon must (closed, stalled, garbage)."""


def frame(msg: Any) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class RawConn:
    """One connection; `fds` collects every descriptor received (when `keep_fds`)."""

    def __init__(self, path: str, timeout_s: float = 10.0, keep_fds: bool = False) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.keep_fds = keep_fds
        self.fds: list[int] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self._buf = bytearray()
        self._ids = iter(range(1, 1 << 62))
        self.eof = False
        self.events: list[dict] = []  # events that arrived while waiting for a reply

    # -- bytes ------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read_some(self, deadline: float) -> bool:
        """One recvmsg into the buffer; False at EOF."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)
        fds = array.array("i")
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(64 * fds.itemsize))
        except ConnectionResetError:
            data, anc = b"", []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        for fd in fds:
            if self.keep_fds:
                self.fds.append(fd)
            else:
                os.close(fd)
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    def take_frame(self) -> dict | None:
        """A complete buffered frame, decoded; None when none is complete yet."""
        if len(self._buf) < 4:
            return None
        (n,) = HEADER.unpack_from(self._buf)
        if n > MAX_REPLY_BYTES:
            raise WireError(f"the daemon sent a frame of {n} bytes")
        if len(self._buf) < 4 + n:
            return None
        body = bytes(self._buf[4:4 + n])
        del self._buf[:4 + n]
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several types on garbage
            raise WireError(f"the daemon sent undecodable msgpack ({type(e).__name__})") from None
        if not isinstance(msg, dict):
            raise WireError(f"the daemon sent a non-map frame: {msg!r:.200}")
        return msg

    def recv(self, timeout_s: float | None = None, skip_events: bool = True) -> dict:
        """The next reply (events set aside in `events`); TimeoutError / ConnectionError as they come."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            msg = self.take_frame()
            if msg is not None:
                if skip_events and "event" in msg:
                    if len(self.events) < 10000:
                        self.events.append(msg["event"])
                    continue
                return msg
            if not self._read_some(deadline):
                raise ConnectionResetError("the daemon closed the connection")

    # -- requests ---------------------------------------------------------------
    def request(self, method: str, params: Any = None, req_id: int | None = None) -> int:
        req_id = next(self._ids) if req_id is None else req_id
        self.send(frame({"id": req_id, "method": method, "params": {} if params is None else params}))
        return req_id

    def call(self, method: str, params: Any = None, timeout_s: float | None = None) -> dict:
        """The whole reply message ({"id", "result"} or {"id", "error"}) of one request."""
        req_id = self.request(method, params)
        while True:
            msg = self.recv(timeout_s)
            if msg.get("id") == req_id:
                return msg

    def hello(self, timeout_s: float | None = None) -> dict:
        reply = self.call("hello", {"version": PROTOCOL_VERSION}, timeout_s)
        if "error" in reply:
            raise WireError(f"hello refused: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange(conn: RawConn, data: bytes, expect_replies: int, timeout_s: float) -> tuple[list[dict], bool]:
    """Write `data` while reading replies (so neither side's buffers can deadlock us);
    returns the non-event replies, up to `expect_replies`, and whether the daemon closed
    the connection. Raises TimeoutError with what arrived when the daemon goes quiet."""
    sock = conn.sock
    sock.setblocking(False)
    out = memoryview(data)
    replies: list[dict] = []
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0))
    closed = False
    try:
        while len(replies) < expect_replies or out:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(replies)} of {expect_replies} replies, {len(out)} bytes unsent "
                                   f"after {timeout_s:.0f}s")
            for key, events in sel.select(min(left, 1.0)):
                if events & selectors.EVENT_WRITE and out:
                    try:
                        n = sock.send(out[:1 << 20])
                    except (BlockingIOError, InterruptedError):
                        n = 0
                    except (BrokenPipeError, ConnectionResetError):
                        out, closed = out[:0], True
                        n = 0
                    out = out[n:]
                    if not out:
                        sel.modify(sock, selectors.EVENT_READ)
                if events & selectors.EVENT_READ:
                    try:
                        alive = conn._read_some(deadline)
                    except (BlockingIOError, InterruptedError):
                        alive = True
                    while (msg := conn.take_frame()) is not None:
                        if "event" not in msg:
                            replies.append(msg)
                    if not alive:
                        return replies, True
            if closed:
                return replies, True
    finally:
        sel.close()
        sock.setblocking(True)
        sock.settimeout(conn.timeout_s)
    return replies, closed


def served_stats(path: str, timeout_s: float = 10.0) -> dict:
    """A fresh, well-behaved client's `stats`, within `timeout_s` in all (connect,
    hello, answer): what every other test asserts the daemon still gives."""
    t0 = time.monotonic()
    try:
        with RawConn(path, timeout_s=timeout_s) as c:
            c.hello(timeout_s=timeout_s)
            reply = c.call("stats", timeout_s=max(0.1, timeout_s - (time.monotonic() - t0)))
    except (OSError, TimeoutError) as e:
        raise WireError(f"a well-behaved client got no stats within {timeout_s:.0f}s: "
                        f"{type(e).__name__}: {e}") from None
    if "error" in reply:
        raise WireError(f"stats refused: {reply['error']}")
    return reply["result"]


def admin_call(path: str, method: str, params: dict | None = None, timeout_s: float = 30.0) -> Any:
    """One call from a fresh connection of this (root) process; the result or WireError."""
    with RawConn(path, timeout_s=timeout_s) as c:
        c.hello(timeout_s=timeout_s)
        reply = c.call(method, params or {}, timeout_s=timeout_s)
    if "error" in reply:
        raise WireError(f"{method} refused: {reply['error']}")
    return reply["result"]


class WireEngine:
    """An engine speaking the protocol itself on a RawConn: register, insert, match,
    release, evict. No page bytes move (none are needed to drive the daemon's state)."""

    def __init__(self, conn: RawConn, layout: Any, device_pages: int, model: str = "wire-engine",
                 extra_key: str = "") -> None:
        reply = conn.call("register", {"model": model, "layout": layout.to_dict(), "device_pages": device_pages,
                                       "extra_key": extra_key})
        if "error" in reply:
            raise WireError(f"register refused: {reply['error']}")
        self.conn = conn
        self.layout = layout
        self.engine_id: int = reply["result"]["engine"]
        self.salt: bytes = reply["result"]["salt"]
        self.device_pages = device_pages

    def keys(self, tokens: Any) -> bytes:
        from hicache.index.keys import page_keys

        return b"".join(page_keys(self.salt, tokens, self.layout.page_size))

    def checked(self, method: str, params: dict) -> Any:
        reply = self.conn.call(method, params)
        if "error" in reply:
            raise WireError(f"{method} refused: {reply['error']}")
        return reply["result"]

    def insert(self, tokens: Any, first_page: int = 1, backup_ok: bool | None = True) -> dict:
        """Insert every full page of `tokens` in device pages first_page.., then report
        the write-through backup (when `backup_ok` is not None)."""
        import numpy as np

        toks = np.asarray(tokens, dtype="<i4")
        n = len(toks) // self.layout.page_size
        result = self.checked("insert", {"engine": self.engine_id, "keys": self.keys(toks),
                                         "tokens": toks[:n * self.layout.page_size].tobytes(),
                                         "device_pages": np.arange(first_page, first_page + n, dtype="<i4").tobytes()})
        if result.get("backup") is not None and backup_ok is not None:
            self.checked("backup_done", {"backup": result["backup"]["id"], "ok": backup_ok})
        return result
