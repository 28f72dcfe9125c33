"""Daemon restarts and shutdown, seen from real engine processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hicache.client.connection import RpcConnection
from hicache.rpc.framing import pack_frame

from tests.daemon.test_robustness import LAYOUT, recv_frame
from tests.wait import wait_until

WORKER = [sys.executable, str(Path(__file__).with_name("engine_worker.py"))]


class Engine:
    """An engine process driven line by line."""

    def __init__(self, socket: str) -> None:
        self.proc = subprocess.Popen([*WORKER, "--socket", socket, "--interactive"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def do(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def close(self) -> int:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        return self.proc.wait(60)


def test_kill9_daemon_mid_cycle_then_restart(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    eng = Engine(d.socket)
    assert eng.do("store:1:40")["connected"]
    assert eng.do("load:1:40")["device_len"] == 10
    d.kill9()
    # the daemon is gone: lookups are misses, stores are skipped, nothing hangs or crashes
    t0 = time.monotonic()
    gone = eng.do("load:1:40")
    assert gone["loaded"] == 0 and not gone["connected"]
    assert eng.do("store:2:40")["stored_pages"] == 10
    assert time.monotonic() - t0 < 30
    d.start()  # same socket path; the stale socket file is replaced
    deadline = time.monotonic() + 60
    while True:  # the client reconnects in the background; a store on the new connection re-teaches it
        eng.do("store:1:40")
        again = eng.do("load:1:40")
        if again["device_len"] == 10 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert again["connected"] and again["device_len"] == 10 and again["bad_pages"] == 0, d.read_log()
    assert eng.close() == 0


def test_sigterm_answers_what_it_read_and_exits_0(daemon):
    conn = RpcConnection.connect(daemon.socket)
    conn.hello()
    reg = conn.call("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 8})
    n = 200
    conn.sock.sendall(b"".join(pack_frame({"id": 1000 + i, "method": "match",
                                           "params": {"engine": reg["engine"], "keys": b""}}) for i in range(n)))
    daemon.proc.send_signal(signal.SIGTERM)
    answered = []
    try:
        while True:
            msg = recv_frame(conn.sock)
            assert "result" in msg or msg["error"]["code"] == "SHUTTING_DOWN"
            answered.append(msg["id"])
    except (ConnectionResetError, OSError):
        pass
    assert answered == list(range(1000, 1000 + len(answered)))  # in order, none skipped
    assert daemon.proc.wait(30) == 0
    assert not os.path.exists(daemon.socket)


def test_ids_of_an_old_daemon_never_reach_a_new_one(daemon_factory):
    import numpy as np

    from hicache.client.client import HiCacheClient

    d = daemon_factory("--host-capacity", "16MiB", "--no-disk").start()
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=d.socket, backoff_s=(0.01, 0.05))
    assert client.connect()
    tokens = np.arange(32, dtype=np.int32)
    client.insert(tokens, np.arange(1, 9, dtype=np.int64))
    old = client.match(tokens)
    assert old.pin is not None and old.device_len == 8
    d.kill9()
    d.start()
    # the old connection is dead: this call fails on it (a skipped store) ...
    assert client.insert(tokens, np.arange(1, 9, dtype=np.int64), pin=old) is None
    wait_until(lambda: client.reconnect_ready, 30, "the background reconnect")
    # ... and this one adopts the new connection but is not sent: its pin belongs to the dead daemon
    client.release(old)
    assert client.connected and client.epoch == 2
    assert client.refusals == 0  # nothing stale was refused, because nothing stale was sent
    fresh = client.match(tokens)
    assert fresh.pin is not None and fresh.device_len == 0  # the new daemon knows nothing of ours
    client.release(fresh)
    client.close()
