"""The `hicache` command line never shows a traceback (issue 14, defect 12): bad arguments,
a closed stdout, a daemon that refuses this peer, a stale socket, an OS error each give
one line on stderr and a non-zero exit. The CLI runs as a real process throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

import pytest

# imported here, as root: the child running as another user cannot read the interpreter's files
import hicache.bench.cli  # noqa: F401
import hicache.cli.admin  # noqa: F401
from hicache.cli.main import CLEAR_SCREEN
from hicache.cli.main import main as cli_main
from tests.pty_run import run_on_pty
from tests.wait import wait_until

CLI = [sys.executable, "-m", "hicache.cli"]
ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def hicache(*args: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, env=env or ENV)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("args,expect", [
    (["stats", "--watch", "-1"], "--watch"),
    (["stats", "--watch", "0"], "--watch"),
    (["stats", "--watch", "nan"], "--watch"),
    (["stats", "--watch", "1e400"], "--watch"),
    (["ls", "--depth", "99999999999999999999"], "--depth"),
    (["ls", "--depth", "-1"], "--depth"),
    (["export", "--chunk-bytes", "abc", "--namespace", "m", "out.bin"], "--chunk-bytes"),
    (["export", "--chunk-bytes", "0", "--namespace", "m", "out.bin"], "--chunk-bytes"),
    (["import", "--chunk-bytes", "1e30", "in.bin"], "--chunk-bytes"),
])
def test_bad_arguments_are_one_line_usage_errors(daemon, args, expect):
    """Against a live daemon: before the fix `--watch -1` printed the stats, then a traceback."""
    line = one_line_error(hicache(*args, "--socket", daemon.socket))
    assert expect in line


def test_output_into_a_closed_pipe_exits_quietly(daemon):
    """`hicache stats --watch 0.01 --json | head -1`: the reader goes away, the CLI stops."""
    proc = subprocess.Popen([*CLI, "stats", "--json", "--watch", "0.01", "--socket", daemon.socket], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("{")
        proc.stdout.close()  # as `head` exits
        assert proc.wait(60) == 128 + 13  # as if killed by SIGPIPE, the shell's convention
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stale_socket_of_a_killed_daemon_is_one_line(daemon):
    daemon.kill9()
    assert os.path.exists(daemon.socket)  # the stale file stays behind
    for args in (["stats"], ["ls"], ["doctor"], ["flush", "--tier", "host"]):
        line = one_line_error(hicache(*args, "--socket", daemon.socket))
        assert "not running" in line and daemon.socket in line, line


def test_debug_shows_the_traceback(daemon):
    daemon.kill9()
    r = hicache("stats", "--socket", daemon.socket, env={**ENV, "HICACHE_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = hicache("--debug", "stats", "--socket", daemon.socket)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_an_os_error_is_one_line(tmp_path):
    r = hicache("serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", "/proc/no/such/dir",
                "--host-capacity", "16MiB", "--disk-capacity", "64MiB")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert err[-1].startswith("hicache: ") and "/proc/no" in err[-1]  # after the daemon's own log lines


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the CLI as another user")
def test_a_daemon_refusing_this_peer_is_named(daemon_factory):
    public = tempfile.mkdtemp(prefix="hicache-cli-")  # pytest's tmp dirs are private to root
    os.chmod(public, 0o755)
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk")
    d.socket = os.path.join(public, "hicache.sock")
    d.start("--socket", d.socket)
    os.chmod(d.socket, 0o666)  # reachable by anyone: the daemon's peer check alone decides
    rc, err = run_cli_as(4446, ["stats", "--socket", d.socket])
    assert rc == 2 and "Traceback" not in err, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "refused by the daemon (peer credentials)" in lines[0], err
    wait_until(lambda: "refusing connection" in d.read_log(), 30, "the daemon's log of the refusal")


def run_cli_as(uid: int, argv: list[str]) -> tuple[int, str]:
    """The real CLI in a forked child running as `uid` (no exec: the interpreter under /root is
    not readable by other users); its exit status and stderr."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.close(r)
            os.dup2(w, 2)
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = cli_main(argv)
        except BaseException:  # shown to the parent, which fails the test
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


# -- stats --watch ----------------------------------------------------------------------------

def test_watch_with_count_appends_views_when_stdout_is_not_a_terminal(daemon):
    r = hicache("stats", "--watch", "0.1", "--count", "3", "--socket", daemon.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("hicache 0.1.0  pid") == 3 and r.stdout.count("every 0.1s") == 3
    assert r.stdout.count("matches/s, 0 pages asked") == 2  # between views: nothing looked up meanwhile
    assert "\x1b[" not in r.stdout  # no screen control into a pipe
    js = hicache("stats", "--json", "--watch", "0.1", "--count", "2", "--socket", daemon.socket)
    assert [json.loads(line)["pid"] for line in js.stdout.splitlines()] == [daemon.proc.pid] * 2


def test_watch_redraws_in_place_on_a_terminal_and_ctrl_c_ends_it(daemon):
    shown = run_on_pty([*CLI, "stats", "--watch", "0.1", "--count", "3", "--socket", daemon.socket],
                       stdout_tty=True, stderr_tty=True, env=ENV)
    assert shown.returncode == 0, shown.terminal
    assert shown.terminal.count(CLEAR_SCREEN) == 3 and shown.terminal.count("device") >= 3
    stopped = run_on_pty([*CLI, "stats", "--watch", "0.1", "--socket", daemon.socket], stdout_tty=True,
                         stderr_tty=True, env=ENV, interrupt_when=lambda text: text.count(CLEAR_SCREEN) >= 2)
    assert stopped.returncode == 0, stopped.terminal  # Ctrl-C is how a watch ends
    assert "Traceback" not in stopped.terminal


def test_count_without_watch_is_a_usage_error(daemon):
    assert "--count needs --watch" in one_line_error(hicache("stats", "--count", "2", "--socket", daemon.socket))
    assert "--count" in one_line_error(hicache("stats", "--watch", "1", "--count", "0", "--socket", daemon.socket))


def test_the_interval_line_gives_hit_rates_between_two_views():
    from hicache.cli.main import _interval_line

    def view(matches: int, asked: int, device: int, host: int) -> dict:
        return {"requests": {"matches": matches, "requested_pages": asked},
                "tiers": {"device": {"hit_rate": device / asked}, "host": {"hit_rate": host / asked}}}

    # since start: 100 pages asked, 50 from device; then 100 more asked, 10 from device, 60 from host
    line = _interval_line(view(10, 100, 50, 0), view(30, 200, 60, 60), 2.0)
    assert line == "last 2.0s: 10.0 matches/s, 100 pages asked; hit rate device 10.0% host 60.0%"
