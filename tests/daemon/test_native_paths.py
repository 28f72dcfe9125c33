"""A user sees which hot paths run in C: a real daemon's `stats --json` names each native path
(index, frame loop, disk writer, copy) with `native`, `python` or `unused` and why, `hicache
stats` prints it, /metrics exports it, and `hicache doctor` warns for each path in Python with
its measured cost (the shipped `hicache bench native` rows). Under CI=true the modules must
have been built (tests/conftest.py); where they were not, the all-native test skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hicache.cli.doctor import cost_line, measured_costs, native_checks
from hicache.daemon.serve.metrics import NATIVE_PATHS, NATIVE_STATES
from hicache.daemon.serve.native_paths import PATHS, RUNS
from hicache.index import native_index
from hicache.kernels import native_build, native_copy
from hicache.rpc import native_conn
from hicache.tiers.disk import native as disk_native
from tests.daemon.disk_faults_util import free_port, metrics_text
from tests.wait import wait_until

MODULES = (native_index.EXTENSION, native_conn.EXTENSION, disk_native.LIBRARY, native_copy.LIBRARY)
SWITCHES = {"index": "HICACHE_NATIVE_INDEX", "frame_loop": "HICACHE_NATIVE_RPC", "disk_writer": "HICACHE_NATIVE_DISK",
            "copy": "HICACHE_NATIVE_COPY"}
needs_native = pytest.mark.skipif(any(m.load() is None for m in MODULES),
                                  reason="the native modules are not built here")


def cli(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache.cli", *args, "--socket", socket], capture_output=True,
                          text=True, timeout=60)


def native_of(socket: str) -> dict[str, dict]:
    out = cli(socket, "stats", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["native"]


def doctor(socket: str) -> dict:
    out = cli(socket, "doctor", "--json")
    assert out.returncode == 0, out.stderr  # warnings only
    return json.loads(out.stdout)


def native_series(port: int) -> dict[str, str]:
    """path -> the state whose series is 1, from /metrics (empty until the first sample)."""
    out = {}
    for line in metrics_text(port).splitlines():
        if line.startswith("hicache_native_path{") and line.endswith(" 1.0"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[labels["path"].strip('"')] = labels["hicache_native_path"].strip('"')
    return out


def test_the_path_names_agree_everywhere():
    assert PATHS == NATIVE_PATHS and RUNS == NATIVE_STATES == ("native", "python", "unused")
    costs = measured_costs()
    assert costs.get("bench") == "native", "hicache/data/native_costs.json is not `hicache bench native --json`"
    for path in PATHS:  # every path has a committed measurement the doctor can quote
        assert cost_line(path, costs), f"no measured cost for {path} in the shipped native_costs.json"


@needs_native
def test_a_default_daemon_runs_every_path_natively_and_says_so(daemon_factory):
    port = free_port()
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB", "--metrics-port", str(port)).start()
    native = native_of(d.socket)
    assert list(native) == list(PATHS)
    sanitize = os.environ.get("HICACHE_SANITIZE", "")
    for path, entry in native.items():
        assert entry["runs"] == "native" and entry["reason"].startswith("loaded hicache."), (path, entry)
        assert entry["build"].startswith("sha256=")
        assert native_build.sanitizers(entry["build"]) == sanitize, (path, entry["build"])  # the build under test
    shown = cli(d.socket, "stats")
    assert "native: index, frame loop, disk writer, copy\n" in shown.stdout
    report = doctor(d.socket)
    checks = {c["name"]: c for c in report["checks"] if c["name"].startswith("native ")}
    assert sorted(checks) == sorted(f"native {p.replace('_', ' ')}" for p in PATHS)
    assert all(c["status"] == "ok" for c in checks.values()), checks
    assert wait_until(lambda: native_series(port) == dict.fromkeys(PATHS, "native") or None, 30,
                      "the native paths on /metrics")


def test_paths_switched_off_run_in_python_and_the_doctor_warns_with_their_cost(daemon_factory):
    port = free_port()
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB", "--metrics-port", str(port),
                       env={v: "0" for v in SWITCHES.values()}).start()
    native = native_of(d.socket)
    for path, switch in SWITCHES.items():
        assert native[path] == {"runs": "python", "reason": f"disabled by {switch}=0", "build": ""}
    shown = cli(d.socket, "stats").stdout
    assert "native: nothing; in Python: index (disabled by HICACHE_NATIVE_INDEX=0); frame loop" in shown
    report = doctor(d.socket)
    costs = measured_costs()
    for path, switch in SWITCHES.items():
        (check,) = [c for c in report["checks"] if c["name"] == f"native {path.replace('_', ' ')}"]
        assert check["status"] == "warn"
        assert check["detail"] == f"runs in Python (disabled by {switch}=0): {cost_line(path, costs)}"
    assert report["warnings"] >= len(PATHS) and report["failures"] == 0
    text = cli(d.socket, "doctor").stdout
    assert "warn  native index        runs in Python (disabled by HICACHE_NATIVE_INDEX=0): match + release " in text
    assert wait_until(lambda: native_series(port) == dict.fromkeys(PATHS, "python") or None, 30,
                      "the native paths on /metrics")


def test_without_a_disk_tier_the_disk_writer_is_unused(daemon):
    native = native_of(daemon.socket)
    assert native["disk_writer"] == {"runs": "unused", "reason": "no disk tier", "build": ""}
    # (the checks as the doctor makes them: its own RPC fails on a --no-disk daemon today)
    (check,) = [c for c in native_checks(native, measured_costs()) if c.name == "native disk writer"]
    assert (check.status, check.detail) == ("ok", "no disk tier")
