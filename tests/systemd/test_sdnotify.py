"""sd_notify over a real AF_UNIX datagram socket, sent from a separate process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hicache.errors import ProtocolError
from hicache.systemd.sdnotify import Notifier, watchdog_interval_s, watchdog_loop

REPO = Path(__file__).resolve().parents[2]
RECV_TIMEOUT_S = 20.0  # a hang guard, not a timing assertion

CHILD = """
import json, os
from hicache.systemd.sdnotify import Notifier
n = Notifier.from_env()
sent = [n.ready(), n.status("warming: 3 of 7\\nlayers"), n.watchdog(), n.stopping(status="draining")]
print(json.dumps({"sent": sent, "left": os.environ.get("NOTIFY_SOCKET"),
                  "watchdog_s": n.watchdog_interval_s, "pid": os.getpid()}))
"""


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    # Ask the kernel for the sender's credentials, as systemd does to apply NotifyAccess=.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(RECV_TIMEOUT_S)
    return sock


def _recv(sock: socket.socket) -> tuple[str, int]:
    """One datagram and the pid the kernel says sent it."""
    data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    pid = next(
        struct.unpack("3i", d)[0]
        for level, kind, d in ancdata
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
    )
    return data.decode(), pid


def _run_child(notify_socket: str, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NOTIFY_SOCKET": notify_socket, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _expect_sequence(sock: socket.socket, child_pid: int) -> None:
    messages = [_recv(sock) for _ in range(4)]
    assert [pid for _, pid in messages] == [child_pid] * 4
    assert [text for text, _ in messages] == [
        "READY=1\n",
        "STATUS=warming: 3 of 7 layers\n",
        "WATCHDOG=1\n",
        "STOPPING=1\nSTATUS=draining\n",
    ]


def test_path_socket_receives_lifecycle_from_subprocess(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        result = _run_child(path, {"WATCHDOG_USEC": "30000000"})
        _expect_sequence(sock, result["pid"])
    assert result["sent"] == [True, True, True, True]
    # Read once, then removed so children of the daemon do not inherit it.
    assert result["left"] is None
    # WATCHDOG_PID unset: the watchdog is ours (sd_watchdog_enabled semantics).
    assert result["watchdog_s"] == 15.0


def test_abstract_socket_receives_lifecycle_from_subprocess():
    name = f"hicache-test-{uuid.uuid4().hex}"
    with _receiver(b"\0" + name.encode()) as sock:
        result = _run_child("@" + name)
        _expect_sequence(sock, result["pid"])
    assert result["sent"] == [True, True, True, True]
    assert result["watchdog_s"] is None


def test_watchdog_pid_of_another_process_disarms_the_watchdog(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        # Our pid, not the child's: the child inherited variables meant for us.
        result = _run_child(path, {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
        _expect_sequence(sock, result["pid"])
    assert result["watchdog_s"] is None


def test_watchdog_interval_is_half_of_watchdog_usec():
    me = str(os.getpid())
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "500000"}) == 0.25
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}) is None


def test_unset_notify_socket_gives_a_silent_noop():
    env = {"WATCHDOG_USEC": "30000000"}
    n = Notifier.from_env(env)
    assert not n.enabled
    assert n.watchdog_interval_s is None
    assert [n.ready(), n.status("x"), n.watchdog(), n.stopping()] == [False] * 4
    assert env == {}


def test_relative_notify_socket_is_ignored(caplog):
    env = {"NOTIFY_SOCKET": "relative/notify.sock"}
    with caplog.at_level(logging.WARNING, logger="hicache.systemd.sdnotify"):
        n = Notifier.from_env(env, unset_environment=False)
    assert not n.enabled
    assert "relative/notify.sock" in caplog.text
    assert env == {"NOTIFY_SOCKET": "relative/notify.sock"}


def test_send_failure_is_logged_once_and_never_raised(tmp_path, caplog):
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert n.enabled
    with caplog.at_level(logging.DEBUG, logger="hicache.systemd.sdnotify"):
        assert n.ready() is False
        assert n.watchdog() is False
        assert n.stopping() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "nobody-listens.sock" in warnings[0].getMessage()
    n.close()


def test_malformed_fields_are_rejected_before_sending(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        n = Notifier(path)
        with pytest.raises(ProtocolError, match="newline"):
            n.notify(STATUS="two\nlines")
        with pytest.raises(ProtocolError, match="field name"):
            n.notify(ready=1)
        with pytest.raises(ProtocolError):
            n.notify()
        with pytest.raises(ProtocolError):
            n.extend_timeout(0)
        # Nothing reached the socket; the next valid message is the first one.
        assert n.extend_timeout(90) is True
        assert n.notify(MAINPID=1234, STATUS="ok") is True
        assert _recv(sock)[0] == "EXTEND_TIMEOUT_USEC=90000000\n"
        assert _recv(sock)[0] == "MAINPID=1234\nSTATUS=ok\n"
        n.close()


def test_watchdog_loop_pings_until_cancelled(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        n = Notifier(path, watchdog_interval_s=0.01)

        async def scenario() -> list[str]:
            task = asyncio.create_task(watchdog_loop(n, n.watchdog_interval_s))
            loop = asyncio.get_running_loop()
            got = [(await loop.run_in_executor(None, _recv, sock))[0] for _ in range(3)]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return got

        assert asyncio.run(scenario()) == ["WATCHDOG=1\n"] * 3
        n.close()


def test_watchdog_loop_rejects_a_nonpositive_interval():
    with pytest.raises(ProtocolError):
        asyncio.run(watchdog_loop(Notifier(None), 0))
