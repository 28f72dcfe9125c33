"""A blocking RPC connection to the daemon (engine schedulers are synchronous).

Low-level errors are translated once, here: any OSError or broken frame
becomes `DaemonUnavailable` and the connection is dropped, because after an
interrupted exchange the stream position is unknown.
"""

from __future__ import annotations

import array
import itertools
import socket
from collections import deque
from typing import Any

from hicache.errors import ClientError, DaemonUnavailable, ProtocolError
from hicache.rpc.framing import HEADER, pack_frame, unpack_body
from hicache.rpc.protocol import PROTOCOL_VERSION

MAX_FRAME_BYTES = 256 << 20
MAX_FDS = 253  # the most one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD)


class RpcConnection:
    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.sock.settimeout(timeout_s)
        self._ids = itertools.count(1)
        self.events: deque[dict] = deque(maxlen=65536)
        self.closed = False

    @classmethod
    def connect(cls, path: str, timeout_s: float = 5.0) -> RpcConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to {path}: {e.strerror or e}") from e
        return cls(sock, timeout_s)

    def hello(self, want_arena: bool = False) -> tuple[dict, list[int]]:
        """Handshake: negotiate the version. Returns the answer and any descriptors that came
        with it (the caller closes them). `want_arena` is ignored (protocol 1 sent the arena)."""
        req_id = next(self._ids)
        self._send({"id": req_id, "method": "hello", "params": {"version": PROTOCOL_VERSION}})
        fds: list[int] = []
        try:
            header, fds = self._recv_with_fds(4)
            (n,) = HEADER.unpack(header)
            body = self._recv_exact(n)
        except OSError as e:
            for fd in fds:
                _close_fd(fd)
            self.close()
            raise DaemonUnavailable(f"hello failed: {e}") from e
        msg = self._decode(body)
        if "error" in msg:
            for fd in fds:
                _close_fd(fd)
            err = msg["error"]
            raise ClientError(err.get("code", "INTERNAL"), err.get("message", ""))
        return msg["result"], fds

    def call(self, method: str, params: dict[str, Any] | None = None, *, fds: list[int] | None = None) -> Any:
        """One request and its answer. With `fds`, descriptors that come with the answer
        (SCM_RIGHTS) are appended there; the caller owns them."""
        if self.closed:
            raise DaemonUnavailable("connection closed")
        req_id = next(self._ids)
        self._send({"id": req_id, "method": method, "params": params or {}})
        while True:
            msg = self._read_message(fds)
            if "event" in msg:
                self.events.append(msg["event"])
                continue
            if msg.get("id") != req_id:
                continue  # an answer to a request we gave up on
            if "error" in msg:
                err = msg["error"]
                raise ClientError(str(err.get("code")), str(err.get("message")))
            return msg.get("result")

    def read_event(self) -> dict:
        if self.events:
            return self.events.popleft()
        while True:
            msg = self._read_message()
            if "event" in msg:
                return msg["event"]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    # -- internals -------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall(pack_frame(msg))
        except OSError as e:
            self.close()
            raise DaemonUnavailable(f"send failed: {e}") from e

    def _read_message(self, fds: list[int] | None = None) -> dict:
        try:
            if fds is None:
                header = self._recv_exact(4)
            else:  # descriptors ride on the first byte of their frame
                header, got = self._recv_with_fds(4)
                fds.extend(got)
            (n,) = HEADER.unpack(header)
            if n > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {n} bytes from the daemon")
            return self._decode(self._recv_exact(n))
        except (OSError, ProtocolError) as e:
            self.close()
            raise DaemonUnavailable(f"receive failed: {e}") from e

    def _decode(self, body: bytes) -> dict:
        try:
            return unpack_body(body)
        except ProtocolError:
            self.close()
            raise

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionResetError("the daemon closed the connection")
            got += k
        return bytes(buf)

    def _recv_with_fds(self, n: int) -> tuple[bytes, list[int]]:
        fds = array.array("i")
        data, ancdata, _, _ = self.sock.recvmsg(n, socket.CMSG_SPACE(MAX_FDS * fds.itemsize),
                                              socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not data:
            raise ConnectionResetError("the daemon closed the connection")
        if len(data) < n:
            data += self._recv_exact(n - len(data))
        return data, list(fds)


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
