"""Fixtures shared by every test directory: real daemon processes on temporary sockets."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hicache.daemon.serve.launcher import LocalDaemon

# Daemons, engine workers and CLI runs are child processes: they must import the
# tree under test, not whatever `hicache` is installed (e.g. an editable install of
# another checkout).
_REPO = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *filter(None, [os.environ.get("PYTHONPATH")])])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="run tests/robustness at full length (>= 100k fuzzed frames, >= 20 kill -9 "
                          "rounds, a soak of minutes) instead of CI's short run")


class DaemonProcess(LocalDaemon):
    def kill9(self) -> None:
        self.stop(signal.SIGKILL)


@pytest.fixture
def daemon_factory(tmp_path):
    """make(*flags, env=None) -> a DaemonProcess (not started) with its own socket and state."""
    started: list[DaemonProcess] = []

    def make(*flags: str, env: dict | None = None) -> DaemonProcess:
        d = DaemonProcess(tmp_path / f"d{len(started)}", *flags, env=env)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop(signal.SIGKILL)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
