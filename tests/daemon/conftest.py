"""A real daemon process on a temporary socket, for tests that talk to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


class DaemonProcess:
    def __init__(self, tmp: Path, *extra: str, env: dict | None = None) -> None:
        self.tmp = tmp
        self.socket = str(tmp / "run" / "hicache.sock")
        self.state_dir = str(tmp / "state")
        self.extra = list(extra)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / "daemon.log"

    def start(self, *more: str, wait: bool = True) -> "DaemonProcess":
        args = [sys.executable, "-m", "hicache.cli", "serve", "--socket", self.socket, "--state-dir",
                self.state_dir, *self.extra, *more]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.read_log()}")
            if os.path.exists(self.socket):  # a stale file from a killed daemon may still be there
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    probe.close()
            time.sleep(0.02)
        raise TimeoutError(f"daemon did not come up:\n{self.read_log()}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProcess] = []

    def make(*extra: str, env: dict | None = None) -> DaemonProcess:
        d = DaemonProcess(tmp_path, *extra, env=env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop(signal.SIGKILL)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
