"""LocalDaemon: `hicache serve` as a child process, for the demo, the benchmarks and the tests."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hicache.errors import HiCacheError

log = logging.getLogger(__name__)


class LocalDaemon:
    """`hicache serve` as a child process with its own socket and state directory under `workdir`."""

    def __init__(self, workdir: str | Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.socket = str(self.workdir / "hicache.sock")
        self.state_dir = str(self.workdir / "state")
        self.flags = list(flags)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = self.workdir / "daemon.log"
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *more_flags: str, timeout_s: float = 60.0) -> LocalDaemon:
        """Start it and wait until it answers; `more_flags` go after the standing ones."""
        if self.running:
            raise HiCacheError("the daemon is already running")
        args = [sys.executable, "-m", "hicache.cli", "serve", "--socket", self.socket,
                "--state-dir", self.state_dir, *self.flags, *more_flags]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise HiCacheError(f"hicache serve exited with {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.socket)  # a stale socket file of a killed daemon refuses
                return
            except OSError:
                time.sleep(0.02)
            finally:
                probe.close()
        self.stop(signal.SIGKILL)
        raise HiCacheError(f"hicache serve did not come up in {timeout_s:.0f}s:\n{self.read_log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the daemon and wait; its exit status (killed after `timeout_s`)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("hicache serve did not stop in %.0fs; killing it", timeout_s)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> LocalDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
