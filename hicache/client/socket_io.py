"""The engine connection's socket: frames read from the daemon into one reusable buffer
(FrameReader), with a deadline or without waiting at all, and frames sent without ever
blocking (Outbox).

The socket stays blocking with SO_RCVTIMEO: a Python socket timeout costs an ioctl per
`settimeout` and a poll per recv, and on a round trip of ~15 µs those syscalls were a
third of it. The kernel timeout is only lowered when a read has less time left than it
(by TIMEOUT_SLACK_S), and raised only when it ran out before the deadline, so calls
alternating between deadlines cost no setsockopt. A read or write that must not wait
passes MSG_DONTWAIT instead.

A frame that is not whole when a deadline passes stays in the buffer, partly read, and
a frame the socket cannot take whole waits in the outbox, in order: the stream's
position is never lost to a deadline, so a late answer is read whole later
(hicache/client/connection.py). Only the peer's close, a socket error, a broken frame
or MAX_OUTBOX_BYTES unread by the daemon end the connection (`lost`).
"""

from __future__ import annotations

import array
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import NoReturn

from hicache.errors import ProtocolError
from hicache.rpc.framing import HEADER, unpack_body

MAX_FRAME_BYTES = 256 << 20
MAX_OUTBOX_BYTES = 8 << 20  # requests the daemon has not read; past it the connection is dead
MAX_FDS = 253  # the most one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD)
RECV_CHUNK = 256 << 10  # the reusable receive buffer; a larger frame grows it for its time
TIMEOUT_SLACK_S = 0.002  # how far past its deadline a read may wait
_TIMEVAL = struct.Struct("@ll")
_monotonic = time.monotonic


class FrameReader:
    """Received bytes not parsed yet are `buf[start:end]`. `lost(why, exc)` is called (and
    must raise) when the connection can no longer be read."""

    def __init__(self, sock: socket.socket, timeout_s: float, lost: Callable[[str, BaseException | None], NoReturn]
                 ) -> None:
        self.sock = sock
        self.lost = lost
        self.buf = bytearray(RECV_CHUNK)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.so_timeout = -1.0  # the SO_RCVTIMEO / SO_SNDTIMEO set now (-1: not yet)
        self.last_heard = _monotonic()  # when bytes last came from the daemon
        sock.settimeout(None)  # blocking: the kernel's socket timeouts bound each read
        self.set_so_timeout(timeout_s)

    @property
    def buffered(self) -> bool:
        return self.start != self.end

    def take(self) -> dict | None:
        """The next whole frame's message, if one is buffered (a frame too large for the
        buffer grows it, so the rest of it can be received)."""
        avail = self.end - self.start
        if avail < 4:
            return None
        (n,) = HEADER.unpack_from(self.buf, self.start)
        if n > MAX_FRAME_BYTES:
            self.lost(f"receive failed: a frame of {n} bytes from the daemon", None)
        if avail < n + 4:
            if n + 4 > len(self.buf) - self.start:
                self._regrow(n + 4)
            return None
        body = self.start + 4
        self.start = body + n
        return self.decode(self.view[body:body + n])

    def decode(self, body: memoryview) -> dict:
        try:
            return unpack_body(body)
        except ProtocolError as e:
            self.lost(f"receive failed: {e}", e)

    def quick(self, deadline: float) -> dict | None:
        """A call's answer in the common case: one receive into the empty buffer holding
        exactly one whole frame (decoded, consumed). Anything else is left buffered for
        `take` (a message decoded here but not wanted is re-read from `start = 0`); None
        also when the deadline passed first."""
        self.start = self.end = 0
        if not self.receive(deadline, None):
            return None
        k = self.end
        if k < 4 or HEADER.unpack_from(self.buf)[0] != k - 4:  # split, or several frames
            return None
        msg = self.decode(self.view[4:k])
        self.start = k
        return msg

    def receive(self, deadline: float | None, fds: list[int] | None) -> bool:
        """One receive into the buffer's free end: by `deadline` (False when it passed with
        nothing received), or at once when `deadline` is None (False when nothing waits).
        With `fds`, descriptors that come along are appended there (they ride on the first
        byte of their frame)."""
        self._make_room()
        view = self.view[self.end:]
        flags = socket.MSG_DONTWAIT if deadline is None else 0
        while True:
            if deadline is not None:
                left = deadline - _monotonic()
                if left <= 0:
                    return False
                if left < self.so_timeout - TIMEOUT_SLACK_S:
                    self.set_so_timeout(left)
            try:
                if fds is None:
                    k = self.sock.recv_into(view, 0, flags)
                else:
                    k, got = self._recvmsg_into(view, flags)
                    fds.extend(got)
            except BlockingIOError:  # nothing waiting, or SO_RCVTIMEO ran out before the deadline
                if deadline is None:
                    return False
                left = deadline - _monotonic()
                if left <= 0:
                    return False
                self.set_so_timeout(left)
                continue
            except OSError as e:
                self.lost(f"receive failed: {e}", e)
            if k == 0:
                self.lost("receive failed: the daemon closed the connection", None)
            self.end += k
            self.last_heard = _monotonic()
            return True

    def _make_room(self) -> None:
        """Move unparsed bytes to the buffer's front when its end is near; give a buffer
        grown for a large frame back once it is empty."""
        if self.start == self.end:
            self.start = self.end = 0
            if len(self.buf) > RECV_CHUNK:
                self.buf = bytearray(RECV_CHUNK)
                self.view = memoryview(self.buf)
        elif len(self.buf) - self.end < RECV_CHUNK // 4:
            n = self.end - self.start
            self.buf[:n] = bytes(self.view[self.start:self.end])  # no overlapping copy
            self.start, self.end = 0, n

    def _regrow(self, size: int) -> None:
        """A buffer of at least `size` bytes holding the unparsed ones at its front (a new
        bytearray: decoded views of the old one may still be alive)."""
        n = self.end - self.start
        buf = bytearray(max(size, RECV_CHUNK))
        buf[:n] = self.view[self.start:self.end]
        self.buf, self.view = buf, memoryview(buf)
        self.start, self.end = 0, n

    def _recvmsg_into(self, view: memoryview, flags: int) -> tuple[int, list[int]]:
        fds = array.array("i")
        k, ancdata, _, _ = self.sock.recvmsg_into([view], socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                                 socket.MSG_CMSG_CLOEXEC | flags)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        return k, list(fds)

    def set_so_timeout(self, seconds: float) -> None:
        """0 would mean 'no timeout' to the kernel: the shortest is one microsecond."""
        usec = max(1, int(seconds * 1e6))
        tv = _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.so_timeout = seconds


class Outbox:
    """Frames sent in order without blocking: what the socket cannot take now waits here and
    leaves with the next `push` or `flush`. `corked`: frames wait until `flush` (an engine
    step's calls in one write: one syscall, one wake-up of the daemon)."""

    def __init__(self, sock: socket.socket, lost: Callable[[str, BaseException | None], NoReturn]) -> None:
        self.sock = sock
        self.lost = lost
        self.data = bytearray()
        self.corked = False
        self._poller: select.poll | None = None

    def push(self, frame: bytes) -> None:
        if self.data or self.corked:
            if len(self.data) + len(frame) > MAX_OUTBOX_BYTES:
                self.lost(f"the daemon read nothing of {MAX_OUTBOX_BYTES >> 20} MiB of requests", None)
            self.data += frame
            if not self.corked:
                self.flush()
            return
        try:
            sent = self.sock.send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self.lost(f"send failed: {e}", e)
        if sent < len(frame):
            self.data += memoryview(frame)[sent:]

    def flush(self) -> None:
        """Send as much as the socket takes now."""
        if not self.data:
            return
        try:
            sent = self.sock.send(self.data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as e:
            self.lost(f"send failed: {e}", e)
        del self.data[:sent]

    def wait(self, deadline: float) -> bool:
        """Wait for the socket to be readable or writable (then flush); False at the deadline."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN | select.POLLOUT)
        left = deadline - _monotonic()
        if left <= 0 or not self._poller.poll(left * 1000):
            return False
        self.flush()
        return True
