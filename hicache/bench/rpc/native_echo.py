"""Native echo servers with hicache's framing (a 4-byte big-endian length, then the
body; hicache/rpc/framing.py), an experiment for issue 31: how close to a redis GET
can a round trip over this socket get once the frame loop is C, and what does
a Python handler behind a C frame loop cost?

Two single-threaded variants, both run as their own process like the daemon:

- `serve_epoll`: a plain C epoll loop that answers every frame with the same
  frame; the floor of any native server, to compare with redis-server;
- `FrameConn`: a C object installed per connection as the event loop's
  `add_reader` callback (uvloop, else asyncio), which receives, splits frames,
  answers and sends in C, so a daemon could keep its event loop and run its
  hot path natively. With a `handler`, each frame's body goes to that Python
  callable (on the loop's thread) and what it returns goes back as a frame.

Replies are the request's bytes, so a hicache client reading one sees its own
request id and no error: `RpcConnection.call` accepts it (its result is None).

The C is hicache/bench/rpc/native_echo.c, compiled by the build (setup.py) into
`hicache.bench.rpc._native_echo`. Where it was not built, or with `HICACHE_NATIVE_ECHO=0`,
`load()` returns None and `unavailable_reason()` says why.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from hicache.kernels import native_build

MAX_FRAME_BYTES = 64 << 20  # as the Python echo server's decoder
VARIANTS = ("epoll", "uvloop", "uvloop-py", "uvloop-msgpack")

EXTENSION = native_build.NativeModule("hicache.bench.rpc._native_echo", "HICACHE_NATIVE_ECHO",
                                      "no native echo servers")
load = EXTENSION.load  # the compiled extension, or None where it was not built
unavailable_reason = EXTENSION.unavailable_reason


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class NativeFrameServer:
    """Accepts on a Unix socket at `path` (in Python: rare) and installs a C `FrameConn`
    as each connection's reader on `loop`; with `handler`, each frame body goes to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, path: str,
                 handler: Callable[[bytes], bytes | None] | None = None) -> None:
        mod = load()
        if mod is None:
            raise RuntimeError(f"native echo server {unavailable_reason()}")
        self._conn_type = mod.FrameConn
        self._loop, self._handler = loop, handler
        self._sock = _listen(path)
        self._conns: list = []
        loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = self._conn_type(self._loop, sock.detach(), self._handler, MAX_FRAME_BYTES)
            self._loop.add_reader(conn.fd, conn)
            self._conns = [c for c in self._conns if c.fd >= 0] + [conn]

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for conn in self._conns:
            conn.close()
        self._conns = []


def same_frame(body: bytes) -> bytes:
    """The Python handler of `uvloop-py`: the price of calling Python per frame."""
    return body


def msgpack_echo_handler() -> Callable[[bytes], bytes]:
    """The handler of `uvloop-msgpack`: the Python echo server's work per frame (decode,
    encode {"id", "result": params}), behind the C frame loop."""
    from hicache.rpc.framing import new_packer, unpack_body

    pack = new_packer().pack

    def handle(body: bytes) -> bytes:
        msg = unpack_body(body)
        return pack({"id": msg["id"], "result": msg.get("params")})
    return handle


def serve(path: str, variant: str) -> None:
    """Serve `variant` (one of VARIANTS) at `path` until the process is stopped."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown native echo variant {variant!r}; known: {', '.join(VARIANTS)}")
    mod = load()
    if mod is None:
        raise RuntimeError(f"native echo server {unavailable_reason()}")
    if variant == "epoll":
        sock = _listen(path)
        mod.serve_epoll(sock.fileno(), MAX_FRAME_BYTES)
        return
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    handler = {"uvloop": None, "uvloop-py": same_frame, "uvloop-msgpack": msgpack_echo_handler()}[variant]
    server = NativeFrameServer(loop, path, handler)
    try:
        loop.run_forever()
    finally:
        server.close()
        loop.close()
