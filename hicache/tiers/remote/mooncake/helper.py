"""The Mooncake client's own process: `python -m hicache.tiers.remote.mooncake.helper`, started
and owned by a daemon's MooncakeStore (hicache/tiers/remote/mooncake/store.py).

Why a process: with its master down, the Mooncake client's `setup()` blocks about
90 s holding the GIL (and `close()` about 0.7 s); inside the daemon that would freeze
its event loop and every RPC behind it. Here it freezes only this process, and the
daemon's calls to it time out like any slow store's.

It inherits two file descriptors: a socket to the daemon (requests and replies, framed
msgpack) and a memfd, the staging area the daemon copies records into and out of. The
area is mapped here and registered with the transfer engine once, so every put and
get is a zero-copy `batch_upsert_from` / `batch_get_into` on it. Requests run on a
few threads (the library releases the GIL in its calls); the daemon bounds how many
it has outstanding, so a master that blocks every call for seconds piles up nothing.

Protocol: request `[id, op, args...]`, reply `[id, ok, result]`; id 0 is the start-up
reply (`[0, True, "ready"]` once set up, or `[0, False, why]` and exit).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

import msgpack

FRAME = struct.Struct("<I")
LOCAL_BUFFER_BYTES = 16 << 20  # the client's own buffer, for copying calls: unused (zero copy)


def read_frame(sock: socket.socket) -> Any | None:
    head = _read_exact(sock, FRAME.size)
    if head is None:
        return None
    body = _read_exact(sock, FRAME.unpack(head)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return FRAME.pack(len(body)) + body


class Helper:
    def __init__(self, args: argparse.Namespace) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.sock = socket.socket(fileno=args.sock_fd)
        self.send_lock = threading.Lock()
        self.area = mmap.mmap(args.staging_fd, args.staging_bytes)
        self.base = ctypes.addressof((ctypes.c_char * args.staging_bytes).from_buffer(self.area))
        self.args = args
        self.store = MooncakeDistributedStore()
        self.config = ReplicateConfig()
        self.config.replica_num = 1
        self.pool = concurrent.futures.ThreadPoolExecutor(args.threads, thread_name_prefix="mooncake")

    def send(self, obj: Any) -> None:
        data = frame(obj)
        with self.send_lock:
            self.sock.sendall(data)

    def setup(self) -> str | None:
        a = self.args
        rc = self.store.setup(a.local_host, a.metadata, 0, LOCAL_BUFFER_BYTES, a.protocol, a.device, a.master)
        if rc != 0:
            return f"setup() returned {rc} (master {a.master}, metadata {a.metadata})"
        rc = self.store.register_buffer(self.base, a.staging_bytes)
        if rc != 0:
            return f"register_buffer() returned {rc}"
        return None

    def serve(self) -> None:
        while True:
            req = read_frame(self.sock)
            if req is None:  # the daemon is gone
                return
            self.pool.submit(self.handle, req)

    def handle(self, req: list) -> None:
        rid, op, *args = req
        try:
            result = getattr(self, "op_" + op)(*args)
        except Exception as e:  # any failure goes back to the daemon as text
            self.send([rid, False, f"{type(e).__name__}: {e}"])
            return
        try:
            self.send([rid, True, result])
        except OSError:
            os._exit(0)

    # -- operations: each one library call -----------------------------------------
    def op_exists(self, keys: list[str]) -> list[int]:
        return list(self.store.batch_is_exist(keys))

    def op_get(self, keys: list[str], offsets: list[int], sizes: list[int]) -> list[int]:
        return list(self.store.batch_get_into(keys, [self.base + o for o in offsets], sizes))

    def op_put(self, keys: list[str], offsets: list[int], sizes: list[int]) -> list[int]:
        # upsert, not put: Mooncake's put of an existing key is a no-op (first write
        # wins), which would keep a damaged or forged record in place for good
        return list(self.store.batch_upsert_from(keys, [self.base + o for o in offsets], sizes, self.config))

    def op_delete(self, regex: str) -> int:
        return int(self.store.remove_by_regex(regex, True))  # force: recently read records too


def _quiet_info_logs() -> None:
    """The library logs a dozen INFO lines per start-up (glog, before any flag is read):
    pass on to the daemon's log only its warnings and errors."""
    r, w = os.pipe()
    err = os.dup(2)
    os.dup2(w, 2)
    os.close(w)

    def forward() -> None:
        with os.fdopen(r, "rb") as lines, os.fdopen(err, "wb", buffering=0) as out:
            for line in lines:
                if not line.startswith((b"I", b"WARNING: Logging before")):
                    out.write(b"mooncake helper: " + line)

    threading.Thread(target=forward, daemon=True).start()


def _die_with_parent() -> None:
    """PR_SET_DEATHSIG: a daemon killed with SIGKILL takes its helper along."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--staging-fd", type=int, required=True)
    p.add_argument("--staging-bytes", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--local-host", required=True)
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device", default="")
    p.add_argument("--threads", type=int, default=4)
    args = p.parse_args(argv)
    _die_with_parent()
    _quiet_info_logs()
    try:
        helper = Helper(args)
    except ImportError as e:
        socket.socket(fileno=args.sock_fd).sendall(frame([0, False, f"cannot import mooncake.store: {e}"]))
        return 2
    why = helper.setup()
    helper.send([0, why is None, why or "ready"])
    if why is not None:
        return 1
    helper.serve()
    os._exit(0)  # the library's own threads must not keep a daemon-less helper alive


if __name__ == "__main__":
    sys.exit(main())
