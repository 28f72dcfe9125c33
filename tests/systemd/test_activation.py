"""Socket activation with real fds: a launcher puts a socket at fd 3, sets
LISTEN_PID to its own pid and execs the daemon side, as systemd does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.errors import ConfigError
from hicache.systemd.activation import SD_LISTEN_FDS_START, listen_fds, listen_fds_with_names

REPO = Path(__file__).resolve().parents[2]

# argv: <fd to place at 3> <LISTEN_PID mode: self|parent> <LISTEN_FDS> <LISTEN_FDNAMES or -> <child code>
LAUNCHER = """
import os, sys
fd, mode, count, names, code = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
os.dup2(fd, 3)  # inheritable copy at SD_LISTEN_FDS_START
os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid() if mode == "self" else os.getppid())
os.environ["LISTEN_FDS"] = count
if names != "-":
    os.environ["LISTEN_FDNAMES"] = names
os.execv(sys.executable, [sys.executable, "-c", code])  # same pid after exec
"""

SERVE_ONE = """
import json, os, sys
from hicache.systemd.activation import listen_fds_with_names
adopted = listen_fds_with_names()
state = {
    "names": [name for name, _ in adopted],
    "fds": [s.fileno() for _, s in adopted],
    "families": [s.family.name for _, s in adopted],
    "inheritable": [os.get_inheritable(s.fileno()) for _, s in adopted],
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}
print(json.dumps(state), flush=True)
if adopted:
    conn, _ = adopted[0][1].accept()
    conn.sendall(b"served by pid %d" % os.getpid())
    conn.close()
"""

REPORT = """
import json, os
from hicache.errors import ConfigError
from hicache.systemd.activation import listen_fds
try:
    socks = listen_fds()
    result = {"count": len(socks), "fd3_open": True}
    try:
        os.fstat(3)
    except OSError:
        result["fd3_open"] = False
except ConfigError as e:
    result = {"error": str(e)}
result["env_left"] = sorted(k for k in os.environ if k.startswith("LISTEN_"))
print(json.dumps(result))
"""


def _launch(sock_fd: int, code: str, *, pid_mode: str = "self", count: str = "1", names: str = "-"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(sock_fd), pid_mode, count, names, code],
        env=env, pass_fds=(sock_fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _read_state(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        pytest.fail(f"child exited {proc.returncode} before reporting: {proc.stderr.read()}")
    return json.loads(line)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_activated_child_accepts_on_the_inherited_socket(tmp_path):
    path = str(tmp_path / "hicache.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    proc = _launch(listener.fileno(), SERVE_ONE, names="rpc")
    # The parent's copy closes: only the child can answer from now on.
    listener.close()
    state = _read_state(proc)
    assert state == {
        "names": ["rpc"],
        "fds": [SD_LISTEN_FDS_START],
        "families": ["AF_UNIX"],
        "inheritable": [False],
        "env_left": [],
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(30)
        client.connect(path)
        reply = client.recv(100)
    assert reply == b"served by pid %d" % proc.pid
    _finish_stdout_consumed(proc)


def _finish_stdout_consumed(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_names_default_to_unknown(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen()
    proc = _launch(listener.fileno(), SERVE_ONE)
    state = _read_state(proc)
    assert state["names"] == ["unknown"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(tmp_path / "s"))
        assert client.recv(100).startswith(b"served by pid")
    _finish_stdout_consumed(proc)
    listener.close()


def test_listen_pid_of_another_process_adopts_nothing(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen()
    result = _finish(_launch(listener.fileno(), REPORT, pid_mode="parent"))
    listener.close()
    # Not ours: nothing adopted, fd 3 left alone, the variables still cleared.
    assert result == {"count": 0, "fd3_open": True, "env_left": []}


def test_datagram_socket_is_refused_with_a_clear_error(tmp_path):
    wrong = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    wrong.bind(str(tmp_path / "d"))
    result = _finish(_launch(wrong.fileno(), REPORT))
    wrong.close()
    assert "fd 3 is AF_UNIX/SOCK_DGRAM" in result["error"]
    assert result["env_left"] == []


def test_tcp_socket_is_refused(tmp_path):
    wrong = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    wrong.bind(("127.0.0.1", 0))
    wrong.listen()
    result = _finish(_launch(wrong.fileno(), REPORT))
    wrong.close()
    assert "fd 3 is AF_INET/SOCK_STREAM" in result["error"]


def test_unlistened_stream_socket_is_refused(tmp_path):
    connected, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    result = _finish(_launch(connected.fileno(), REPORT))
    connected.close()
    peer.close()
    assert "fd 3 is not listening" in result["error"]


def test_regular_file_is_refused(tmp_path):
    f = open(tmp_path / "not-a-socket", "wb")
    result = _finish(_launch(f.fileno(), REPORT))
    f.close()
    assert "fd 3 is not a socket" in result["error"]


def test_more_fds_than_passed_is_refused(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen()
    # Claims two fds; fd 4 is not open in the child.
    result = _finish(_launch(listener.fileno(), REPORT, count="2"))
    listener.close()
    assert "fd 4 is not open" in result["error"]


def test_not_activated_gives_no_sockets():
    assert listen_fds({}) == []
    env = {"LISTEN_FDS": "1"}  # no LISTEN_PID: not for us
    assert listen_fds(env) == []
    assert env == {}


def test_malformed_variables_raise_and_are_cleared():
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "many"}
    with pytest.raises(ConfigError, match="LISTEN_FDS='many'"):
        listen_fds_with_names(env)
    assert env == {}
    env = {"LISTEN_PID": "systemd", "LISTEN_FDS": "1"}
    with pytest.raises(ConfigError, match="LISTEN_PID"):
        listen_fds(env, unset_environment=False)
    assert "LISTEN_PID" in env


def test_zero_fds_for_us_is_empty():
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0", "LISTEN_FDNAMES": ""}
    assert listen_fds(env) == []
    assert env == {}
