"""Hybrid models through a real daemon: state checkpoints stored, matched, restored byte-exact."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache.client.connection import RpcConnection

WORKER = [sys.executable, str(Path(__file__).with_name("hybrid_worker.py"))]


class Engine:
    """An interactive hybrid engine process: one request per call."""

    def __init__(self, socket: str, *extra: str) -> None:
        self.proc = subprocess.Popen([*WORKER, "--socket", socket, "--interactive", *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def serve(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine died:\n{self.proc.stderr.read()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        assert self.proc.returncode == 0, self.proc.stderr.read()


@pytest.fixture
def engines():
    started: list[Engine] = []

    def make(socket: str, *extra: str) -> Engine:
        e = Engine(socket, *extra)
        started.append(e)
        return e

    yield make
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()


def daemon_stats(socket: str) -> dict:
    c = RpcConnection.connect(socket)
    try:
        c.hello()
        return c.call("stats")
    finally:
        c.close()


ISSUE_SEQUENCE = [("1,2", 0), ("1,3", 0), ("1,4", 256), ("1,2,5", 512), ("1,4,5", 512), ("1,3,5", 256),
                  ("1,3", 256), ("1,3", 512)]


def test_the_issue_sequence_through_the_daemon_with_two_engines(daemon, engines):
    # requests alternate between two engine processes: KV and state come through the host tier
    a, b = engines(daemon.socket), engines(daemon.socket)
    results = [(a if i % 2 == 0 else b).serve(f"blocks:{ids}") for i, (ids, _) in enumerate(ISSUE_SEQUENCE)]
    assert [r["usable"] for r in results] == [want for _, want in ISSUE_SEQUENCE]
    assert all(r["exact"] for r in results), results
    assert all(r["state_exact"] for r in results if r["usable"]), results
    # the fork of 1+3 inside the 1+2 node was announced, and the engine offered it with its end
    assert results[1]["fork_at"] == 256 and results[1]["offered"] == [256, 512] and results[1]["stored"] == 1
    a.close()
    b.close()
    st = daemon_stats(daemon.socket)["states"]
    assert st["host_checkpoints"] == 7 and st["pending_backups"] == 0  # 256; three at 512; three at 768
    assert st["usable_tokens"] == sum(want for _, want in ISSUE_SEQUENCE)


def test_seed_scenes_with_a_checkpoint_every_64_tokens(daemon, engines):
    a, b = engines(daemon.socket), engines(daemon.socket)
    # scene 1: 230 tokens (14 full pages of 16: 224), chunked prefill offers 64, 128, 192
    assert a.serve("seq:1:230:64")["usable"] == 0
    r = b.serve("seq:1:230")
    assert r["usable"] == 192 and r["kv_len"] == 224 and r["exact"] and r["state_exact"]
    # scene 2: 280 tokens (17 full pages: 272) -> 256
    a.serve("seq:2:280:64")
    r = b.serve("seq:2:280")
    assert r["usable"] == 256 and r["exact"] and r["state_exact"]
    # sharing 180 tokens with it: the KV match is 176, so the checkpoint at 192 is out of reach
    r = b.serve("mix:2:180:9:300")
    assert (r["kv_len"], r["usable"], r["fork_at"]) == (176, 128, 176) and r["exact"] and r["state_exact"]
    a.close()
    b.close()


def test_checkpoints_come_back_from_disk_after_a_restart(daemon_factory, engines):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "256MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    a = engines(d.socket)
    assert a.serve("blocks:1,2")["stored"] == 1
    a.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = daemon_stats(d.socket)
        if st["states"]["disk_checkpoints"] == 1 and st["tiers"]["disk"]["queue_depth"] == 0:
            break
        time.sleep(0.05)
    assert st["states"]["disk_checkpoints"] == 1
    assert d.stop() == 0
    d.start()
    st = daemon_stats(d.socket)["states"]
    assert st["restored"] == 1 and st["disk_checkpoints"] == 1 and st["host_checkpoints"] == 0
    b = engines(d.socket)
    r = b.serve("blocks:1,2,5")  # KV and state both read back from disk
    assert r["usable"] == 512 and r["exact"] and r["state_exact"], r
    b.close()
    assert daemon_stats(d.socket)["states"]["disk_reads"] == 1


def test_register_and_insert_refuse_bad_state_parameters(daemon):
    from hicache.client.client import HiCacheClient
    from hicache.engine.hybrid_model import HybridConfig, HybridModel
    from hicache.errors import ClientError

    model = HybridModel(HybridConfig())
    layout, state = model.kv_layout(16), model.state_layout(64).to_dict()
    c = RpcConnection.connect(daemon.socket)
    c.hello()
    base = {"model": "hybrid-bad", "layout": layout.to_dict(), "device_pages": 64}
    for bad in ({**state, "chunk_size": 40}, {**state, "conv_shapes": [[0, 3]]}, {**state, "extra": 1}, [1]):
        with pytest.raises(ClientError) as e:
            c.call("register", {**base, "state": bad})
        assert e.value.code == "BAD_PARAMS"
    plain = c.call("register", base)  # no state: a pure-attention namespace
    with pytest.raises(ClientError):
        c.call("insert", {"engine": plain["engine"], "keys": b"", "tokens": b"", "device_pages": b"",
                          "states": [[64, 1]]})
    hybrid = c.call("register", {**base, "state": state})
    assert hybrid["salt"] != plain["salt"] and hybrid["state_bytes"] == model.state_layout().checkpoint_bytes
    for bad in ([[64]], [[64, 0]], [[64, 1], [64, 2]], [["a", 1]], 5):
        with pytest.raises(ClientError):
            c.call("insert", {"engine": hybrid["engine"], "keys": b"", "tokens": b"", "device_pages": b"",
                              "states": bad})
    with pytest.raises(ClientError):
        c.call("state_backup_done", {"backup": 12345})
    c.close()
    client = HiCacheClient(layout, 64, model="hybrid-bad", socket_path=daemon.socket,
                           state=model.state_layout(64))
    assert client.connect() and client.salt == hybrid["salt"]
    client.close()
