"""A blocking RPC connection to the daemon (engine schedulers are synchronous).

Low-level errors are translated once, here: any OSError or broken frame
becomes `DaemonUnavailable` and the connection is dropped, because after an
interrupted exchange the stream position is unknown. Each exchange has a
deadline (`timeout_s` per call, the connection's default otherwise) over all
of its reads, so a daemon that stopped mid-reply costs one deadline, not one
per read. `connect` checks who listens (hicache/client/peer.py) before a byte
is sent.

The socket stays blocking with SO_RCVTIMEO / SO_SNDTIMEO: a Python socket
timeout costs an ioctl per `settimeout` and a poll per recv, and on a round
trip of ~15 µs those syscalls were a third of it. The kernel timeout is only
lowered when an exchange has less time left than it (by TIMEOUT_SLACK_S), and
raised only when it ran out before the deadline, so calls alternating between
deadlines (match 0.25 s, release 0.5 s) cost no setsockopt. Replies are read
in chunks into one reusable buffer, so a frame usually takes one recv; an answer
that came whole and alone is decoded from there without further checks
(`_quick_read`). A match's frame is spliced from a template (`call_blob`,
hicache/rpc/framing.py's BlobRequest) rather than packed from a dict.
"""

from __future__ import annotations

import array
import itertools
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, NoReturn

from hicache.client.peer import check_daemon
from hicache.errors import ClientError, DaemonRefused, DaemonUnavailable, ProtocolError
from hicache.rpc.framing import HEADER, BlobRequest, new_packer, pack_frame, unpack_body
from hicache.rpc.protocol import PROTOCOL_VERSION

MAX_FRAME_BYTES = 256 << 20
REFUSED_CODES = {"FORBIDDEN"}  # a daemon that says why it refuses this peer
MAX_FDS = 253  # the most one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD)
RECV_CHUNK = 256 << 10  # the reusable receive buffer; larger frames get their own
TIMEOUT_SLACK_S = 0.002  # how far past its deadline an exchange may wait
MAX_POSTED = 64  # posted requests not yet known handled; beyond, a post first waits for them (`sync`)
# call_many's window: requests sent before their answers are read. The daemon handles 64 frames a
# loop turn (FRAMES_PER_TURN) and stops reading while its output is unread, so a window stays
# well under a Unix socket's buffer (~208 KiB) and the send cannot block on a daemon waiting for us.
MAX_PIPELINED = 64
PIPELINE_BYTES = 128 << 10
_TIMEVAL = struct.Struct("@ll")
_monotonic = time.monotonic

log = logging.getLogger(__name__)


def _outcome(msg: dict) -> Any:
    """An answer's result, or its refusal as a ClientError (returned, not raised)."""
    if "error" in msg:
        err = msg["error"]
        return ClientError(str(err.get("code")), str(err.get("message")))
    return msg.get("result")


class RpcConnection:
    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self.events: deque[dict] = deque(maxlen=65536)
        self.closed = False
        # called once as the connection is dropped, before the socket closes: the daemon frees
        # what the connection held as soon as it sees the close
        self.on_close: Callable[[], None] | None = None
        self._packer = new_packer()  # a connection is one thread's at a time
        self._buf = bytearray(RECV_CHUNK)  # received bytes not parsed yet: _buf[_start:_end]
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._so_timeout = -1.0  # the SO_RCVTIMEO / SO_SNDTIMEO set now (-1: not yet)
        # id -> method of requests sent by post() that may still be answered (they are only
        # when refused); the answer to any later call clears them: the daemon goes in order
        self._posted: dict[int, str] = {}
        self.posted_refusals = 0  # posted requests the daemon answered with an error
        sock.settimeout(None)  # blocking: the kernel's socket timeouts bound each read and write
        self._set_so_timeout(timeout_s)

    @classmethod
    def connect(cls, path: str, timeout_s: float = 5.0, daemon_uids: Collection[int] | None = None
                ) -> RpcConnection:
        """Connect and check the listener's uid (`daemon_uids`: the trusted ones, default
        per hicache/client/peer.py); DaemonUntrusted, with nothing sent, when it is not."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(_connect_failure(path, e)) from e
        try:
            check_daemon(sock, path, daemon_uids)
        except BaseException:
            sock.close()
            raise
        return cls(sock, timeout_s)

    @classmethod
    def one_call(cls, path: str, method: str, params: dict[str, Any] | None = None,
                 timeout_s: float = 5.0) -> Any:
        """Connect (checking who listens), hello, one call, close: the admin CLI's and
        tools' way to ask the daemon something."""
        conn = cls.connect(path, timeout_s=timeout_s)
        try:
            conn.hello()
            return conn.call(method, params or {})
        finally:
            conn.close()

    def hello(self, timeout_s: float | None = None) -> tuple[dict, list[int]]:
        """Handshake: negotiate the version. Returns the answer and any descriptors that came
        with it (none from a daemon of this protocol; the caller closes them).

        Its own deadline matters: `connect()` succeeds into a stopped daemon's listen
        backlog, so only the hello tells a live daemon from a hung one."""
        deadline = self._deadline(timeout_s)
        req_id = next(self._ids)
        frame = pack_frame({"id": req_id, "method": "hello", "params": {"version": PROTOCOL_VERSION}})
        fds: list[int] = []
        try:
            self._send_bytes(frame, deadline)
            header, fds = self._recv_with_fds(4, deadline)
            (n,) = HEADER.unpack(header)
            body = self._recv_exact(n, deadline)
        except OSError as e:
            for fd in fds:
                _close_fd(fd)
            self.close()
            if isinstance(e, (ConnectionResetError, BrokenPipeError)) and not fds:
                # The daemon hangs up on a peer it does not allow before reading a byte.
                raise DaemonRefused("refused by the daemon (peer credentials): it closed the connection "
                                    "before answering hello (this uid/group is not allowed, or it is "
                                    "shutting down)") from e
            raise DaemonUnavailable(f"hello failed: {_describe(e, timeout_s or self.timeout_s)}") from e
        msg = self._decode(body)
        if "error" in msg:
            for fd in fds:
                _close_fd(fd)
            err = msg["error"]
            if err.get("code") in REFUSED_CODES:
                self.close()
                raise DaemonRefused(f"refused by the daemon (peer credentials): {err.get('message', '')}")
            raise ClientError(err.get("code", "INTERNAL"), err.get("message", ""))
        return msg["result"], fds

    def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = None, *,
             fds: list[int] | None = None) -> Any:
        """One request; its reply within `timeout_s` (the connection's default when None),
        else DaemonUnavailable and the connection is dropped. With `fds`, descriptors that
        come with the answer (SCM_RIGHTS) are appended there; the caller owns them."""
        if self.closed:
            raise DaemonUnavailable("connection closed")
        req_id = next(self._ids)
        body = self._packer.pack({"id": req_id, "method": method, "params": params or {}})
        return self._exchange(HEADER.pack(len(body)) + body, req_id, method, timeout_s, fds)

    def call_blob(self, request: BlobRequest, blob: bytes, timeout_s: float | None = None) -> Any:
        """`call(request.method, {**request.fixed, <its blob key>: blob})` with the frame
        spliced from a prebuilt template (rpc/framing.py): the engine's `match`."""
        if self.closed:
            raise DaemonUnavailable("connection closed")
        req_id = next(self._ids)
        return self._exchange(request.frame(req_id, blob), req_id, request.method, timeout_s, None)

    def _exchange(self, frame: bytes, req_id: int, method: str, timeout_s: float | None,
                  fds: list[int] | None) -> Any:
        """Send a request's frame, read up to its answer: the result, or its refusal raised.
        Every call's round trip, so the common case (one send; the whole answer alone in
        one recv, nothing else buffered) takes few calls and no copies: the client's
        Python was a third of a round trip to a C server (docs/benchmarks.md)."""
        deadline = _monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self._send_frame(frame, deadline)
        msg = None
        if fds is None and self._start == self._end:
            msg = self._quick_read(deadline, method)
        if msg is None or msg.get("id") != req_id or "event" in msg:
            if msg is not None:  # an event or another request's answer came first: the general path
                self._start = 0
            msg = self._reply(req_id, method, deadline, fds)
        elif self._posted:  # the daemon handled every request sent before this one
            self._posted.clear()
        if "error" in msg:
            err = msg["error"]
            raise ClientError(str(err.get("code")), str(err.get("message")))
        return msg.get("result")

    def _quick_read(self, deadline: float, method: str) -> dict | None:
        """One recv into the empty buffer; the message when it holds exactly one whole
        frame, else None with the bytes left buffered for `_reply` (which then re-reads
        from `_start`, so an event decoded here is not lost)."""
        try:
            left = deadline - _monotonic()
            if left <= 0 or left < self._so_timeout - TIMEOUT_SLACK_S:
                self._wait(deadline)
            self._start = self._end = 0
            try:
                k = self._end = self.sock.recv_into(self._view)
            except BlockingIOError:  # the socket's timeout ran out before the deadline
                self._rearm(deadline)
                return None
            if k < 4:
                if k == 0:
                    raise ConnectionResetError("the daemon closed the connection")
                return None
            if HEADER.unpack_from(self._buf)[0] != k - 4:  # split, several frames: the general path
                return None
            msg = unpack_body(self._view[4:k])
        except (OSError, ProtocolError) as e:
            self._read_failed(e, method)
        self._start = k
        return msg

    def call_many(self, calls: Sequence[tuple[str, dict[str, Any] | None]], timeout_s: float | None = None
                  ) -> list[Any]:
        """Several requests, pipelined: their frames go out together and their answers are
        read in order (the daemon handles a connection's frames in order), so the batch
        costs one round trip, not one per request. One deadline, `timeout_s`, covers the
        whole batch; when it passes, DaemonUnavailable and the connection is dropped, as
        for `call`. A request the daemon refuses gets its ClientError in its place of the
        result list; the others are unaffected. Frames go in windows of at most
        MAX_PIPELINED requests and PIPELINE_BYTES, each read back before the next is
        sent: the daemon stops reading a connection whose answers are not read, so an
        unbounded burst could block on a full socket. For methods answered inline, without
        descriptors (match, put, ...)."""
        if self.closed:
            raise DaemonUnavailable("connection closed")
        deadline = self._deadline(timeout_s)
        results: list[Any] = []
        pending: tuple[int, str, bytes] | None = None  # packed but did not fit the last window
        todo = iter(calls)
        while True:
            window: list[tuple[int, str, bytes]] = [] if pending is None else [pending]
            size = 0 if pending is None else len(pending[2])
            pending = None
            for method, params in todo:
                req_id = next(self._ids)
                frame = pack_frame({"id": req_id, "method": method, "params": params or {}}, self._packer)
                if window and size + len(frame) > PIPELINE_BYTES:
                    pending = (req_id, method, frame)
                    break
                window.append((req_id, method, frame))
                size += len(frame)
                if len(window) >= MAX_PIPELINED:
                    break
            if not window:
                return results
            self._send_frame(b"".join(f for _, _, f in window), deadline)
            for req_id, method, _ in window:
                results.append(_outcome(self._reply(req_id, method, deadline, None)))

    def _reply(self, req_id: int, method: str, deadline: float, fds: list[int] | None) -> dict:
        """Read up to the answer to `req_id`: events met on the way are kept, posted
        requests' refusals logged. Reads from `_start`: a message `_quick_read`
        decoded but did not return is read again."""
        while True:
            msg = self._read_message(deadline, method, fds)
            if "event" in msg:
                self.events.append(msg["event"])
                continue
            if msg.get("id") != req_id:
                self._settle_posted(msg)  # a posted request's refusal, or an answer we gave up on
                continue
            if self._posted:  # the daemon handled every request sent before this one
                self._posted.clear()
            return msg

    def post(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = None) -> None:
        """Send a request and return without waiting: for calls whose answer the caller
        does not need (a pin's release, a finished put), so a slow daemon costs the engine's
        step nothing and cannot drop the connection by missing a deadline. The daemon
        handles a connection's requests in order, so a later call sees the posted one done.
        It answers a posted request (`noreply`) only to refuse it; whichever read comes
        next logs that. For methods the daemon answers inline (not `load`). Past MAX_POSTED
        posts not known handled, this first waits until they are (`wait_posted`), which
        bounds the refusals that can pile up unread."""
        if len(self._posted) >= MAX_POSTED:
            self.wait_posted(timeout_s)
        if self.closed:
            raise DaemonUnavailable("connection closed")
        req_id = next(self._ids)
        self._send({"id": req_id, "method": method, "params": params or {}, "noreply": True},
                   self._deadline(timeout_s))
        self._posted[req_id] = method

    def wait_posted(self, timeout_s: float | None = None) -> None:
        """Return once the daemon has handled every posted request (for callers that next
        ask the daemon something on another connection): one `sync` round trip, whose
        answer comes after any refusal of them."""
        if not self._posted:
            return
        try:
            self.call("sync", None, timeout_s)
        except ClientError:
            self._posted.clear()  # a daemon without `sync` refused it, after the earlier ones all the same

    def _settle_posted(self, msg: dict) -> None:
        method = self._posted.pop(msg.get("id"), None)  # type: ignore[arg-type]
        if method is not None and "error" in msg:
            err = msg["error"]
            self._refused(method, err.get("code"), err.get("message"))

    def _refused(self, method: str, code: Any, message: Any) -> None:
        self.posted_refusals += 1
        log.warning("hicache daemon refused %s (sent without waiting): %s: %s", method, code, message)

    def read_event(self) -> dict:
        if self.events:
            return self.events.popleft()
        while True:
            msg = self._read_message()
            if "event" in msg:
                return msg["event"]
            self._settle_posted(msg)

    def close(self) -> None:
        if not self.closed:
            hook, self.on_close = self.on_close, None
            if hook is not None:
                try:
                    hook()
                except Exception:  # the connection must close whatever the hook does
                    log.exception("on_close hook failed")
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    # -- internals -------------------------------------------------------------
    def _send(self, msg: dict, deadline: float | None = None) -> None:
        self._send_frame(pack_frame(msg, self._packer), deadline)

    def _send_frame(self, data: bytes, deadline: float | None) -> None:
        try:
            left = -1.0 if deadline is None else deadline - _monotonic()
            if left > 0 and left >= self._so_timeout - TIMEOUT_SLACK_S:  # `_wait` has nothing to do
                try:
                    sent = self.sock.send(data)  # almost always all of it: the socket buffer has room
                except BlockingIOError:
                    self._rearm(deadline)  # type: ignore[arg-type]
                    sent = 0
                if sent < len(data):
                    self._send_bytes(data, deadline, sent)
            else:
                self._send_bytes(data, deadline)
        except OSError as e:
            self.close()
            raise DaemonUnavailable(f"send failed: {e}") from e

    def _send_bytes(self, data: bytes, deadline: float | None, sent: int = 0) -> None:
        """`data[sent:]`, within the deadline."""
        if deadline is None:
            deadline = self._deadline(None)
        view = memoryview(data)
        while sent < len(data):
            self._wait(deadline)
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:
                self._rearm(deadline)

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _read_message(self, deadline: float | None = None, method: str = "", fds: list[int] | None = None
                      ) -> dict:
        if deadline is None:  # the default timeout, over the whole message
            deadline = self._deadline(None)
        try:
            while self._end - self._start < 4:
                self._fill(deadline, fds)
            (n,) = HEADER.unpack_from(self._buf, self._start)
            if n > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {n} bytes from the daemon")
            if n + 4 > len(self._buf):
                return self._decode(self._read_big(n, deadline, fds))
            while self._end - self._start < n + 4:
                self._fill(deadline, fds)
            start = self._start + 4
            self._start = start + n
            return self._decode(self._view[start:start + n])
        except (OSError, ProtocolError) as e:
            self._read_failed(e, method)

    def _read_failed(self, e: Exception, method: str) -> NoReturn:
        self.close()
        if isinstance(e, TimeoutError):
            raise DaemonUnavailable(f"no answer to {method or 'a read'} in time (the daemon is hung or "
                                    "overloaded)") from e
        raise DaemonUnavailable(f"receive failed: {e}") from e

    def _fill(self, deadline: float, fds: list[int] | None) -> None:
        """Receive more bytes after _end, first moving unparsed ones to the buffer's front
        when the end is near. With `fds`, descriptors that come along are appended there
        (they ride on the first byte of their frame)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < RECV_CHUNK // 4:
            n = self._end - self._start
            self._buf[:n] = bytes(self._view[self._start:self._end])  # no overlapping copy
            self._start, self._end = 0, n
        self._end += self._recv_into(self._view[self._end:], deadline, fds)

    def _read_big(self, n: int, deadline: float, fds: list[int] | None) -> bytes:
        """A frame larger than the buffer: its own bytearray."""
        have = self._end - self._start - 4
        body = bytearray(n)
        body[:have] = self._view[self._start + 4:self._end]
        self._start = self._end = 0
        view = memoryview(body)
        while have < n:
            have += self._recv_into(view[have:], deadline, fds)
        return bytes(body)

    def _recv_into(self, view: memoryview, deadline: float, fds: list[int] | None) -> int:
        """One receive into `view` (at least a byte) within the deadline; with `fds`,
        descriptors that come along are appended there."""
        while True:
            self._wait(deadline)
            try:
                if fds is None:
                    k = self.sock.recv_into(view)
                else:
                    k, got = self._recvmsg_into(view)
                    fds.extend(got)
            except BlockingIOError:
                self._rearm(deadline)
                continue
            if k == 0:
                raise ConnectionResetError("the daemon closed the connection")
            return k

    def _recvmsg_into(self, view: memoryview) -> tuple[int, list[int]]:
        fds = array.array("i")
        k, ancdata, _, _ = self.sock.recvmsg_into([view], socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                                 socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        return k, list(fds)

    def _decode(self, body: bytes | memoryview) -> dict:
        try:
            return unpack_body(body)
        except ProtocolError:
            self.close()
            raise

    def _wait(self, deadline: float) -> None:
        """Bound the next blocking read or write by the exchange's deadline: lower the
        socket's timeout when it would overshoot by more than the slack."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        if left < self._so_timeout - TIMEOUT_SLACK_S:
            self._set_so_timeout(left)

    def _rearm(self, deadline: float) -> None:
        """The socket's timeout ran out (EAGAIN on a blocking socket): a timeout if the
        deadline passed too, else the rest of the time for the next try."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self._set_so_timeout(left)

    def _set_so_timeout(self, seconds: float) -> None:
        """0 would mean 'no timeout' to the kernel: the shortest is one microsecond."""
        usec = max(1, int(seconds * 1e6))
        tv = _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._so_timeout = seconds

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        """Exactly n bytes (the handshake reads no further than its reply)."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            got += self._recv_into(view[got:n], deadline, None)
        return bytes(buf)

    def _recv_with_fds(self, n: int, deadline: float) -> tuple[bytes, list[int]]:
        fds = array.array("i")
        while True:
            self._wait(deadline)
            try:
                data, ancdata, _, _ = self.sock.recvmsg(n, socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                                      socket.MSG_CMSG_CLOEXEC)
                break
            except BlockingIOError:
                self._rearm(deadline)
                continue
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not data:
            raise ConnectionResetError("the daemon closed the connection")
        if len(data) < n:
            data += self._recv_exact(n - len(data), deadline)
        return data, list(fds)


def _connect_failure(path: str, e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return f"no socket at {path}"
    if isinstance(e, ConnectionRefusedError):
        return f"nothing listens on {path} (a stale socket of a daemon that died?)"
    return f"cannot connect to {path}: {e.strerror or e}"


def _describe(e: OSError, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):
        return f"no answer in {timeout_s:g}s (the daemon is hung or overloaded)"
    return str(e)


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
