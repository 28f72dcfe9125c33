"""A real daemon process on a temporary socket, for tests that talk to it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from hicache.daemon.launcher import LocalDaemon


class DaemonProcess(LocalDaemon):
    def __init__(self, tmp: Path, *extra: str, env: dict | None = None) -> None:
        super().__init__(tmp, *extra, env=env)
        self.socket = str(tmp / "run" / "hicache.sock")
        (tmp / "run").mkdir(parents=True, exist_ok=True)

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
