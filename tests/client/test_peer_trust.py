"""Clients check who listens on the socket before sending a byte (issue 14, defect 3).

A fake daemon run by another uid on the socket path gets nothing: not the engine's
hello, not its keys, not a CLI's request. Configured uids are trusted, which also
shows that the fake daemon does count what a trusting client sends.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from hicache.client.async_client import AsyncRpcConnection
from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.errors import DaemonUnavailable, DaemonUntrusted
from tests.client.fake_daemon import FakeDaemon
from tests.daemon.test_robustness import LAYOUT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")

ATTACKER = 4747


@pytest.fixture
def fake():
    with FakeDaemon(ATTACKER) as f:
        yield f


def test_blocking_connection_refuses_an_untrusted_listener_and_sends_nothing(fake):
    with pytest.raises(DaemonUntrusted, match=f"uid {ATTACKER}"):
        RpcConnection.connect(fake.socket, timeout_s=5)
    assert fake.stop() == 0


def test_engine_client_sends_no_key_to_an_untrusted_listener(fake):
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=fake.socket)
    try:
        assert not client.connect()
        tokens = np.arange(64, dtype=np.int32)
        assert client.match(tokens).pin is None  # a miss, answered locally
        assert client.insert(tokens, np.arange(1, 17, dtype=np.int64)) is None  # skipped
        assert not client.poll()
    finally:
        client.close()
    assert fake.stop() == 0


def test_async_connection_refuses_an_untrusted_listener(fake):
    with pytest.raises(DaemonUntrusted):
        asyncio.run(AsyncRpcConnection.connect(fake.socket, timeout_s=5))
    assert fake.stop() == 0


@pytest.mark.parametrize("command", [["stats"], ["ls"], ["flush", "--tier", "host"], ["doctor"],
                                     ["export", "--namespace", "m", "out.bin"]])
def test_cli_commands_refuse_an_untrusted_listener(fake, command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_DAEMON_UIDS"}
    r = subprocess.run([sys.executable, "-m", "hicache.cli", *command, "--socket", fake.socket], cwd=tmp_path,
                       env={**env, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"uid {ATTACKER}" in lines[0] and "trusted" in lines[0], lines
    assert fake.stop() == 0


def test_a_configured_daemon_uid_is_trusted(fake, monkeypatch):
    """The positive control: trusted, the same listener gets the hello (and never answers it:
    the hello's own deadline ends the wait)."""
    conn = RpcConnection.connect(fake.socket, timeout_s=5, daemon_uids={ATTACKER})
    with pytest.raises(DaemonUnavailable, match="no answer"):
        conn.hello(timeout_s=0.2)
    assert fake.stop() > 0


def test_daemon_uids_from_the_environment(fake, monkeypatch):
    monkeypatch.setenv("HICACHE_DAEMON_UIDS", str(ATTACKER))
    conn = RpcConnection.connect(fake.socket, timeout_s=5)
    conn.close()
    client = HiCacheClient(LAYOUT, 64, model="m", socket_path=fake.socket, daemon_uids=[])  # explicit wins
    try:
        assert not client.connect()
    finally:
        client.close()
    assert fake.stop() == 0
