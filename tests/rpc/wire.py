"""Raw-socket helpers for the RPC tests: frames by hand, clients as other users."""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import socket
import struct
import tempfile
import termios
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from hicache.layout import KVLayout
from hicache.index.keys import page_keys
from hicache.rpc.framing import ids_to_bytes, pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8)


def raw(path: str, timeout_s: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.connect(path)
    return s


def recv_raw(s: socket.socket) -> bytes:
    """One frame's body, as it came."""
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("the daemon closed the connection")
            buf += chunk
        return buf

    (n,) = struct.unpack(">I", exact(4))
    return exact(n)


def recv_frame(s: socket.socket) -> dict:
    return msgpack.unpackb(recv_raw(s), raw=False)


def request(s: socket.socket, req_id: int, method: str, params: dict | None = None) -> dict:
    """Send one request and read frames until its answer (events are skipped)."""
    s.sendall(pack_frame({"id": req_id, "method": method, "params": params or {}}))
    while True:
        msg = recv_frame(s)
        if msg.get("id") == req_id:
            return msg


def one_page_branches(conn: Any, reg: dict, n: int, batch: int = 200) -> None:
    """Insert `n` one-page sequences (a tree `n` branches wide) through `conn` (hello'd,
    `reg` its register reply), pipelined a batch at a time; the `stats` after each batch
    reads the batch's replies."""
    for start in range(0, n, batch):
        frames = []
        for i in range(start, min(start + batch, n)):
            tokens = np.full(4, i, dtype=np.int32)
            frames.append(pack_frame({"id": 10 + i, "method": "insert", "params": {
                "engine": reg["engine"], "keys": b"".join(page_keys(reg["salt"], tokens, 4)),
                "tokens": tokens.tobytes(), "device_pages": ids_to_bytes([1 + i])}}))
        conn.sock.sendall(b"".join(frames))
        conn.call("stats")


def greet(s: socket.socket) -> dict:
    reply = request(s, 0, "hello", {"version": PROTOCOL_VERSION})
    assert "result" in reply, reply
    return reply["result"]


def unread_bytes(s: socket.socket) -> int:
    """Bytes waiting in our receive queue (FIONREAD)."""
    n = array.array("i", [0])
    fcntl.ioctl(s.fileno(), termios.FIONREAD, n)
    return n[0]


def wait_until(cond: Callable[[], Any], timeout_s: float, poll_s: float = 0.01) -> Any:
    """cond()'s first truthy value, or its last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll_s)


def closed_by_peer(s: socket.socket, timeout_s: float) -> bool:
    """Drain the socket until the daemon closes it (True) or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            continue
        try:
            if not s.recv(1 << 20):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def hung_up(s: socket.socket, timeout_s: float) -> bool:
    """Whether the daemon closes the connection within timeout_s, seen without reading
    (POLLHUP): for a client that must stay a non-reader."""
    p = select.poll()
    p.register(s, select.POLLHUP | select.POLLRDHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, ev in p.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            if ev & (select.POLLHUP | select.POLLRDHUP):
                return True
    return False


def public_dir() -> str:
    """A 0755 directory: pytest's tmp dirs are private to root, other test users must reach the socket."""
    d = tempfile.mkdtemp(prefix="hicache-rpc-")
    os.chmod(d, 0o755)
    return d


def start_public(daemon_factory: Callable[..., Any], *flags: str, env: dict[str, str]) -> Any:
    d = daemon_factory(*flags, env=env)
    d.socket = os.path.join(public_dir(), "hicache.sock")
    d.start("--socket", d.socket)
    os.chmod(d.socket, 0o666)  # let every test user reach the socket: the peer check alone decides
    return d


class AsUser:
    """Run fn(channel) in a forked child as uid/gid/groups (no exec: the interpreter under /root
    is not readable by other users); `channel` passes lines both ways, fn's return comes back as JSON."""

    def __init__(self, uid: int, gid: int, groups: list[int], fn: Callable[[AsUser], Any]) -> None:
        down_r, self._down_w = os.pipe()
        self._up_r, up_w = os.pipe()
        res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            os.close(self._down_w)
            os.close(self._up_r)
            os.close(res_r)
            self._in, self._out = os.fdopen(down_r), os.fdopen(up_w, "w")
            try:
                os.setgroups(groups)
                os.setgid(gid)
                os.setuid(uid)
                out = {"ok": fn(self)}
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(res_w, json.dumps(out).encode())
            os._exit(0)
        os.close(down_r)
        os.close(up_w)
        os.close(res_w)
        self._in, self._out = os.fdopen(self._up_r), os.fdopen(self._down_w, "w")
        self._res = res_r

    # both sides
    def say(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def hear(self) -> str:
        return self._in.readline().strip()

    # parent side
    def result(self) -> Any:
        with os.fdopen(self._res) as f:
            out = json.loads(f.read() or '{"error": "the child died"}')
        os.waitpid(self.pid, 0)
        self._in.close()
        self._out.close()
        if "error" in out:
            raise AssertionError(f"child failed: {out['error']}")
        return out["ok"]


def as_user(uid: int, gid: int, groups: list[int], fn: Callable[[AsUser], Any]) -> Any:
    return AsUser(uid, gid, groups, fn).result()
