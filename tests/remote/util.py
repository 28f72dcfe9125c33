"""Helpers for the remote tier's tests: daemons wired to a store, stats, engines."""

from __future__ import annotations

import json
import time

from hicache.client.connection import RpcConnection
from tests.wait import wait_until

DAEMON_FLAGS = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")


def remote_env(url: str, **more: str) -> dict[str, str]:
    """A daemon on the store at `url`; its lookups get a deadline sized for a loaded CI
    machine (the fault tests use the default of a few ms)."""
    return {"HICACHE_REMOTE_URL": url, "HICACHE_LOAD_POLICY": "wait_complete",
            "HICACHE_REMOTE_LOOKUP_TIMEOUT_S": "0.5", "HICACHE_REMOTE_NEGATIVE_TTL_S": "0", **more}


def admin(socket: str, method: str, params: dict | None = None) -> dict:
    return RpcConnection.one_call(socket, method, params or {}, timeout_s=30.0)


def remote_stats(socket: str) -> dict:
    return admin(socket, "stats")["tiers"]["remote"]


def wait_remote_up(socket: str, timeout_s: float = 30.0) -> dict:
    return wait_until(lambda: (st := remote_stats(socket))["available"] and st, timeout_s,
                      "the remote tier to be up")


def two_daemons(daemon_factory, url: str, **env: str):
    """Two daemons (DAEMON_FLAGS) sharing the store at `url`, each with its remote tier up."""
    a = daemon_factory(*DAEMON_FLAGS, env=remote_env(url, **env)).start()
    b = daemon_factory(*DAEMON_FLAGS, env=remote_env(url, **env)).start()
    wait_remote_up(a.socket)
    wait_remote_up(b.socket)
    return a, b


def wait_written(socket: str, pages: int, timeout_s: float = 30.0) -> dict:
    """Until `pages` pages were written to the store and nothing is in flight."""
    def done() -> dict | None:
        st = remote_stats(socket)
        return st if st["written_pages"] >= pages and st["queue_pages"] == 0 else None
    return wait_until(done, timeout_s, f"{pages} pages written to the remote store")


def dump(socket: str) -> str:
    return json.dumps(admin(socket, "stats"))


def elapsed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
