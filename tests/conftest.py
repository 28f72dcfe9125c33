"""Fixtures shared by every test directory: real daemon processes on temporary sockets."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hicache.daemon.serve.launcher import LocalDaemon
from hicache.rpc import native_conn

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


@pytest.fixture(scope="module", params=["native", "asyncio"])
def frame_loop(request):
    """Runs a module's tests on each of the daemon's frame loops: the C one
    (hicache/rpc/native_conn.py) and the asyncio Protocol fallback. Daemons started under
    it inherit HICACHE_NATIVE_RPC; in-process servers take `native=(frame_loop == "native")`.
    Without a compiler the native runs skip, except under CI=true, where they must run."""
    if request.param == "native" and native_conn.load() is None:
        reason = f"native frame loop {native_conn.unavailable_reason()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    old = os.environ.get("HICACHE_NATIVE_RPC")
    os.environ["HICACHE_NATIVE_RPC"] = "1" if request.param == "native" else "0"
    yield request.param
    if old is None:
        os.environ.pop("HICACHE_NATIVE_RPC", None)
    else:
        os.environ["HICACHE_NATIVE_RPC"] = old
