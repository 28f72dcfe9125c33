"""A real `hicache serve` process under systemd's protocols: sd_notify (READY, STATUS,
STOPPING, WATCHDOG), socket activation (LISTEN_FDS / LISTEN_PID) and the metrics port.

The test plays the service manager: it binds the notify socket (with SO_PASSCRED,
to see which pid sent each message, as NotifyAccess=main does) and, for socket
activation, owns the listening socket and hands it to the daemon at fd 3 through
a launcher that sets LISTEN_PID to its own pid and execs, as systemd does.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
RECV_TIMEOUT_S = 30.0  # hang guards, not timing assertions
EXIT_TIMEOUT_S = 60.0
LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8)

LAUNCHER = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)  # inheritable copy at SD_LISTEN_FDS_START
os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())  # exec keeps the pid
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "rpc"
os.execv(sys.executable, [sys.executable, "-m", "hicache.cli", *sys.argv[2:]])
"""


class NotifyReceiver:
    """The service manager's end of $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(RECV_TIMEOUT_S)
        self.received: list[tuple[dict[str, str], int]] = []

    def next(self) -> tuple[dict[str, str], int]:
        """One message as {field: value} and the sender's pid (kernel-attached credentials)."""
        data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        pid = next(struct.unpack("3i", d)[0] for level, kind, d in ancdata
                   if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.received.append((fields, pid))
        return fields, pid

    def until(self, field: str) -> dict[str, str]:
        while True:
            fields, _ = self.next()
            if field in fields:
                return fields

    def drain(self) -> None:
        self.sock.settimeout(0.0)
        try:
            while True:
                self.next()
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(RECV_TIMEOUT_S)

    def close(self) -> None:
        self.sock.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_", "HICACHE_"))}
    return {**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}


def _serve_args(tmp: Path, *extra: str) -> list[str]:
    return ["serve", "--state-dir", str(tmp / "state"), "--host-capacity", "64MiB", "--disk-capacity", "256MiB",
            *extra]


def _serve(tmp: Path, *extra: str, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp / "daemon.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "hicache.cli", *_serve_args(tmp, *extra)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def _launch_activated(tmp: Path, listener: socket.socket, *extra: str, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp / "daemon.log", "ab")
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(listener.fileno()), *_serve_args(tmp, *extra)],
                            env=env, pass_fds=(listener.fileno(),), stdout=log, stderr=subprocess.STDOUT)


def _call(path: str, method: str, params: dict | None = None):
    conn = RpcConnection.connect(path, timeout_s=RECV_TIMEOUT_S)
    try:
        conn.hello()
        return conn.call(method, params)
    finally:
        conn.close()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ready_status_and_stopping(tmp_path, procs):
    notify = NotifyReceiver(tmp_path / "notify.sock")
    sock = str(tmp_path / "run" / "hicache.sock")
    proc = _serve(tmp_path, "--socket", sock, env=_env(NOTIFY_SOCKET=notify.path))
    procs.append(proc)

    fields, pid = notify.next()
    assert pid == proc.pid  # the main process itself (NotifyAccess=main)
    assert fields["READY"] == "1" and fields["STATUS"] == "serving; host 64.0MiB"
    # READY means the tiers are up and the socket answers: no retry needed
    st = _call(sock, "stats")
    assert st["pid"] == proc.pid
    assert st["tiers"]["host"]["capacity_bytes"] == 64 << 20 and st["tiers"]["disk"]["capacity_bytes"] == 256 << 20

    proc.send_signal(signal.SIGTERM)
    stopping = notify.until("STOPPING")
    assert stopping == {"STOPPING": "1", "STATUS": "draining requests"}
    assert notify.until("STATUS") == {"STATUS": "flushing the disk tier"}
    assert proc.wait(EXIT_TIMEOUT_S) == 0
    notify.drain()
    assert {pid for _, pid in notify.received} == {proc.pid}
    assert not any("WATCHDOG" in f for f, _ in notify.received)  # no WATCHDOG_USEC: no pings
    assert not os.path.exists(sock)  # a socket it bound itself is removed
    notify.close()


def test_watchdog_pings_when_armed(tmp_path, procs):
    notify = NotifyReceiver(tmp_path / "notify.sock")
    sock = str(tmp_path / "run" / "hicache.sock")
    proc = _serve(tmp_path, "--socket", sock, env=_env(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="400000"))
    procs.append(proc)
    assert notify.until("READY")["READY"] == "1"
    for _ in range(3):  # every WATCHDOG_USEC / 2, from the event loop
        assert notify.until("WATCHDOG") == {"WATCHDOG": "1"}
    assert _call(sock, "stats")["pid"] == proc.pid  # pinging does not get in the way of serving
    proc.send_signal(signal.SIGTERM)
    notify.until("STOPPING")
    assert proc.wait(EXIT_TIMEOUT_S) == 0
    notify.drain()
    assert {pid for _, pid in notify.received} == {proc.pid}
    notify.close()


def test_socket_activation_serves_on_the_passed_socket_across_restarts(tmp_path, procs):
    """The socket unit's fd outlives the daemon: a client that connects while no
    daemon runs waits in the backlog and is answered by the next one."""
    path = str(tmp_path / "hicache.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what hicache.socket holds
    listener.bind(path)
    os.chmod(path, 0o660)
    listener.listen(16)
    notify = NotifyReceiver(tmp_path / "notify.sock")
    unused = tmp_path / "unused" / "hicache.sock"
    env = _env(NOTIFY_SOCKET=notify.path)

    first = _launch_activated(tmp_path, listener, "--socket", str(unused), env=env)
    procs.append(first)
    assert notify.until("READY")["READY"] == "1"
    conn = RpcConnection.connect(path, timeout_s=RECV_TIMEOUT_S)
    hello, _ = conn.hello()
    assert hello["pid"] == first.pid
    assert conn.call("stats")["pid"] == first.pid
    conn.close()
    engine = HiCacheClient(LAYOUT, 16, model="m", socket_path=path, timeout_s=RECV_TIMEOUT_S)
    assert engine.connect()
    reply = engine.insert(np.arange(8, dtype=np.int32), np.array([1, 2]))
    assert reply is not None and reply.backup is not None
    assert engine.arena.backed.sum() == 1  # a slab fd came over the adopted socket too (SCM_RIGHTS)
    engine.close()
    assert not unused.exists() and not unused.parent.exists()  # --socket is ignored when a socket is passed

    first.send_signal(signal.SIGTERM)
    assert first.wait(EXIT_TIMEOUT_S) == 0
    assert os.path.exists(path)  # not the daemon's to remove: the socket unit owns it

    waiting = RpcConnection.connect(path, timeout_s=RECV_TIMEOUT_S)  # queued in the backlog, no daemon
    second = _launch_activated(tmp_path, listener, env=env)
    procs.append(second)
    hello, _ = waiting.hello()
    assert hello["pid"] == second.pid
    assert waiting.call("stats")["pid"] == second.pid
    waiting.close()
    second.send_signal(signal.SIGTERM)
    assert second.wait(EXIT_TIMEOUT_S) == 0
    listener.close()
    notify.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=RECV_TIMEOUT_S) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_port_serves_hicache_metrics(tmp_path, procs):
    from tests.daemon.test_cycle import run_worker

    port = _free_port()
    sock = str(tmp_path / "run" / "hicache.sock")
    notify = NotifyReceiver(tmp_path / "notify.sock")
    proc = _serve(tmp_path, "--socket", sock, "--metrics-port", str(port), env=_env(NOTIFY_SOCKET=notify.path))
    procs.append(proc)
    notify.until("READY")
    for _ in range(3):
        _call(sock, "stats")
    _call(sock, "ls", {"depth": 1})
    run_worker(sock, "store:1:42", "load:1:42")  # register, match, insert, backups, ...

    samples = _scrape(port)
    names = {name for name, _ in samples}
    assert all(n.startswith(("hicache_", "process_", "python_")) for n in names)
    assert samples[("hicache_requests_total", (("code", "OK"), ("method", "stats")))] >= 3
    assert samples[("hicache_requests_total", (("code", "OK"), ("method", "ls")))] == 1
    assert samples[("hicache_requests_total", (("code", "OK"), ("method", "insert")))] >= 1
    assert samples[("hicache_rpc_latency_seconds_count", (("method", "match"),))] >= 1
    assert ("hicache_rpc_latency_seconds_bucket", (("le", "+Inf"), ("method", "match"))) in samples
    # tier gauges are sampled once a second: wait for a sample after the engine's pages (a hang guard)
    deadline = time.monotonic() + RECV_TIMEOUT_S
    while samples[("hicache_tier_pages", (("tier", "host"),))] != 10:
        assert time.monotonic() < deadline, "tier gauges never showed the stored pages"
        time.sleep(0.1)
        samples = _scrape(port)
    # counters sampled from the daemon: the load was a device hit of 10 pages (the same engine)
    while samples.get(("hicache_hits_total", (("tier", "device"),)), 0) < 10:
        assert time.monotonic() < deadline, "hit counters never moved"
        time.sleep(0.1)
        samples = _scrape(port)
    assert samples[("hicache_misses_total", ())] >= 10  # the first store's lookup missed 10 pages
    assert samples[("hicache_bytes_moved_total", (("dst", "host"), ("src", "device")))] == 10 * 768
    assert samples[("hicache_tier_capacity_bytes", (("tier", "host"),))] == 64 << 20
    assert samples[("hicache_tier_capacity_bytes", (("tier", "disk"),))] == 256 << 20
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(EXIT_TIMEOUT_S) == 0
    with pytest.raises(OSError):  # the endpoint goes with the daemon
        _scrape(port)
    notify.close()
