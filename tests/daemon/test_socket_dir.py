"""The daemon refuses a socket directory another user could control (issue 14, defect 3).

Without a runtime directory the socket falls back to `$TMPDIR/hicache-<uid>`, a name any
local user can create first (or plant as a symlink). The daemon `lstat`s it: a real
directory, ours, mode 0700, else it refuses to start with one line saying what to do.
Explicit directories keep the looser rule (ours or root's) but no symlink and no
directory others may write to without the sticky bit. Real `hicache serve` processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.daemon.serve.launcher import LocalDaemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's directory")

OTHER = 4747
SERVE = [sys.executable, "-m", "hicache.cli", "serve", "--host-capacity", "16MiB", "--no-disk"]


def env_with_tmpdir(tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "HICACHE_SOCKET_PATH")}
    return {**env, "TMPDIR": str(tmpdir), "PYTHONPATH": os.getcwd()}


def serve_refused(tmp_path: Path, *args: str) -> str:
    """Run `hicache serve` expecting a refusal; its one error line."""
    r = subprocess.run([*SERVE, "--state-dir", str(tmp_path / "state"), *args], env=env_with_tmpdir(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # after the daemon's own log lines
    assert last.startswith("hicache: "), r.stderr
    return last


def default_dir(tmp_path: Path) -> Path:
    return tmp_path / f"hicache-{os.getuid()}"


def test_default_dir_created_by_another_user_is_refused(tmp_path):
    d = default_dir(tmp_path)
    d.mkdir(mode=0o700)
    os.chown(d, OTHER, OTHER)
    line = serve_refused(tmp_path)
    assert str(d) in line and f"uid {OTHER}" in line and "rm -r" in line


def test_default_dir_planted_as_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)  # even one of ours: the link's owner chose where we bind
    default_dir(tmp_path).symlink_to(target)
    line = serve_refused(tmp_path)
    assert "symbolic link" in line
    assert not list(target.iterdir())  # nothing was bound through it


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o1777, 0o750])
def test_default_dir_with_a_loose_mode_is_refused(tmp_path, mode):
    d = default_dir(tmp_path)
    d.mkdir()
    os.chmod(d, mode)
    line = serve_refused(tmp_path)
    assert f"{mode:04o}" in line and "chmod 700" in line


def test_default_dir_is_created_private_and_served(tmp_path):
    sock = default_dir(tmp_path) / "hicache.sock"
    proc = subprocess.Popen([*SERVE, "--state-dir", str(tmp_path / "state")], env=env_with_tmpdir(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        daemon = LocalDaemon(tmp_path)  # only for its readiness probe on the default path
        daemon.socket, daemon.proc = str(sock), proc
        daemon._wait_ready(60)
        st = default_dir(tmp_path).lstat()
        assert st.st_uid == os.getuid() and (st.st_mode & 0o7777) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()


def test_explicit_dir_behind_a_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    line = serve_refused(tmp_path, "--socket", str(tmp_path / "link" / "hicache.sock"))
    assert "symbolic link" in line


def test_explicit_dir_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)  # anyone could replace the socket with their own
    line = serve_refused(tmp_path, "--socket", str(d / "hicache.sock"))
    assert "writable by other users" in line and "chmod go-w" in line


def test_explicit_dir_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, OTHER, OTHER)
    line = serve_refused(tmp_path, "--socket", str(d / "hicache.sock"))
    assert f"uid {OTHER}" in line


def test_explicit_sticky_dir_of_root_is_accepted(daemon_factory, tmp_path):
    """Like /tmp itself: others may write there, but cannot remove or rename our socket."""
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    daemon = daemon_factory("--host-capacity", "16MiB", "--no-disk")
    daemon.socket = str(d / "hicache.sock")
    daemon.start("--socket", daemon.socket)
    assert daemon.stop() == 0


def test_a_refused_socket_directory_is_refused_before_the_tiers_come_up(tmp_path):
    """No arena allocated and no disk tier opened (or rebuilt) for a daemon that cannot serve."""
    d = default_dir(tmp_path)
    d.mkdir(mode=0o700)
    os.chown(d, OTHER, OTHER)
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--host-capacity", "16MiB",
                        "--state-dir", str(tmp_path / "state")], env=env_with_tmpdir(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"uid {OTHER}" in r.stderr
    assert "host tier" not in r.stderr  # the arena's log line
    assert not (tmp_path / "state" / "disk").exists()
