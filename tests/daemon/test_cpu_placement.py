"""`hicache serve --cpus LIST`: the daemon and every one of its threads on those CPUs, a bad
list refused before anything is created, and the setting read from flags, files and variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.client.connection import RpcConnection
from hicache.config import load_config
from hicache.cpu_list import format_cpu_list, parse_cpu_list
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.errors import ConfigError
from tests.wait import wait_until


def _thread_cpus(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        out[int(tid)] = next(ln.split(":", 1)[1].strip() for ln in status.splitlines()
                             if ln.startswith("Cpus_allowed_list"))
    return out


def test_cpu_lists_parse_and_print():
    assert parse_cpu_list("0-2,5 7-9:2") == {0, 1, 2, 5, 7, 9}
    assert format_cpu_list({0, 1, 2, 5, 7, 9}) == "0-2,5,7,9"
    for bad in ("", "x", "1-0", "0-4:0", "1,,a"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_setting_comes_from_flags_files_and_variables(tmp_path):
    assert load_config(None, {"cpus": "1,3-4"}, environ={}).cpus == (1, 3, 4)
    assert load_config(None, {}, environ={"HICACHE_CPUS": "2"}).cpus == (2,)
    toml = tmp_path / "hicache.toml"
    toml.write_text("[hicache]\ncpus = [3, 1]\n")
    assert load_config(toml, {}, environ={}).cpus == (1, 3)
    assert load_config(None, {}, environ={}).cpus == ()
    for bad in ("a-b", "3-1"):
        with pytest.raises(ConfigError, match="cpus: not a CPU list"):
            load_config(None, {"cpus": bad}, environ={})
    toml.write_text('[hicache]\ncpus = ["one"]\n')
    with pytest.raises(ConfigError, match="cpus"):
        load_config(toml, {}, environ={})


def test_the_daemon_and_all_its_threads_run_on_the_cpus_given(tmp_path):
    cpu = max(os.sched_getaffinity(0))  # one CPU of those this test may use (on one CPU: that one)
    with LocalDaemon(tmp_path, "--host-capacity", "64MiB", "--disk-capacity", "64MiB", "--cpus", str(cpu)) as d:
        assert d.proc is not None
        # the disk tier's writer and the other threads started while serving, too
        RpcConnection.one_call(d.socket, "stats", timeout_s=10.0)
        threads = wait_until(lambda: _thread_cpus(d.proc.pid), what="the daemon's threads")
        assert len(threads) > 1
        assert set(threads.values()) == {str(cpu)}, threads
        assert f"daemon on CPUs {cpu} (--cpus)" in d.read_log()


def test_a_cpu_the_daemon_may_not_use_is_refused_before_anything_is_made(tmp_path):
    state = tmp_path / "state"
    outside = max(os.sched_getaffinity(0)) + 1024  # no machine this runs on has it
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--state-dir", str(state), "--host-capacity", "64MiB", "--no-disk",
                          "--cpus", f"0,{outside}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    allowed = format_cpu_list(os.sched_getaffinity(0))
    assert f"CPU {outside} is not one this daemon may run on (allowed: {allowed}" in out.stderr
    assert not state.exists() and not (tmp_path / "s.sock").exists()
    bad = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--cpus", "two"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "not a CPU list: 'two'" in bad.stderr
