"""A fake daemon: a plain Unix socket listening as another uid, counting every byte sent to it.

It is what a local attacker runs on a socket path an engine will use. The child is
forked without exec (the interpreter under /root is not readable by other users),
drops to `uid`, binds and listens, and accepts and reads until told to stop.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
from pathlib import Path


class FakeDaemon:
    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-fake-"))  # pytest's tmp dirs are private to root
        os.chmod(self.dir, 0o755)
        sock_dir = self.dir / "run"
        sock_dir.mkdir()
        os.chown(sock_dir, uid, uid)
        self.socket = str(sock_dir / "hicache.sock")
        self.pid = 0
        self._ctl_w = self._count_r = -1

    def __enter__(self) -> FakeDaemon:
        ready_r, ready_w = os.pipe()
        count_r, count_w = os.pipe()
        ctl_r, ctl_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never returns
            code = 1
            try:
                os.close(ready_r), os.close(count_r), os.close(ctl_w)
                os.setgroups([])
                os.setgid(self.uid)
                os.setuid(self.uid)
                _serve(self.socket, ready_w, ctl_r, count_w)
                code = 0
            finally:
                os._exit(code)
        os.close(ready_w), os.close(count_w), os.close(ctl_r)
        self.pid, self._ctl_w, self._count_r = pid, ctl_w, count_r
        with os.fdopen(ready_r, "rb") as f:
            if f.read(1) != b"r":
                self.stop()
                raise RuntimeError("the fake daemon did not start")
        return self

    def stop(self) -> int:
        """Stop it; the number of bytes it received from all connections."""
        if not self.pid:
            return -1
        os.close(self._ctl_w)
        with os.fdopen(self._count_r, "rb") as f:
            out = f.read()
        os.waitpid(self.pid, 0)
        self.pid = 0
        return int(out) if out else -1

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _serve(path: str, ready_w: int, ctl_r: int, count_w: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(16)
    os.write(ready_w, b"r")
    os.close(ready_w)
    conns: list[socket.socket] = []
    control = [ctl_r]
    received = 0
    while True:
        readable, _, _ = select.select([listener, *control, *conns], [], [], None if control else 0.0)
        if not readable and not control:
            break  # stopping, and everything sent before the stop has been read
        for r in readable:
            if r is ctl_r:
                control.clear()  # the parent closed its end: drain, then report
            elif r is listener:
                conns.append(listener.accept()[0])
            else:
                try:
                    data = r.recv(1 << 16)
                except OSError:
                    data = b""
                received += len(data)
                if not data:
                    conns.remove(r)
                    r.close()
    os.write(count_w, str(received).encode())
    os.close(count_w)
