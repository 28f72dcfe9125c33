"""Fixtures shared by every test directory: real daemon processes on temporary sockets."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hicache.bench.rpc import native_echo
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.index import native_index
from hicache.kernels import native_build, native_copy
from hicache.rpc import native_conn
from hicache.tiers.disk import native as disk_native

# Daemons, engine workers and CLI runs are child processes: they must import the
# tree under test, not whatever `hicache` is installed (e.g. an editable install of
# another checkout).
_REPO = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *filter(None, [os.environ.get("PYTHONPATH")])])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="run tests/robustness at full length (>= 100k fuzzed frames, >= 20 kill -9 "
                          "rounds, a soak of minutes) instead of CI's short run")


NATIVE_MODULES = (native_index.EXTENSION, native_conn.EXTENSION, disk_native.LIBRARY, native_copy.LIBRARY,
                  native_echo.EXTENSION)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"{m.name}: {m.unavailable_reason() or m.build_info()}" for m in NATIVE_MODULES]
    return ["native modules (tests of a path that did not load skip, except under CI=true):", *lines]


@pytest.fixture(scope="session", autouse=True)
def native_modules_loaded() -> None:
    """Under CI=true every native module must have loaded (setup builds them), and under
    HICACHE_SANITIZE (scripts/test_sanitized.sh) each must be the build with those
    sanitizers: otherwise every test fails, so a silent fallback to Python, or to the
    plain build, cannot pass."""
    sanitize = os.environ.get("HICACHE_SANITIZE", "")
    if os.environ.get("CI") != "true" and not sanitize:
        return
    wrong = [f"{m.name}: {m.unavailable_reason()}" for m in NATIVE_MODULES if m.load() is None]
    wrong += [f"{m.name}: built with sanitize={native_build.sanitizers(m.build_info()) or 'none'}, not {sanitize}"
              for m in NATIVE_MODULES if sanitize and m.load() is not None
              and native_build.sanitizers(m.build_info()) != sanitize]
    if wrong:
        pytest.fail("native modules not loaded as this run requires:\n" + "\n".join(wrong))


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
