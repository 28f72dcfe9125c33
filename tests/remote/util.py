"""Helpers for the remote tier's tests: daemons wired to a store, stats, engines."""

from __future__ import annotations

import json
import time

from hicache.client.connection import RpcConnection
from tests.wait import wait_until

DAEMON_FLAGS = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")


def remote_env(url: str, **more: str) -> dict[str, str]:
    """A daemon on the store at `url`, waiting for every load, remembering no miss."""
    return {"HICACHE_REMOTE_URL": url, "HICACHE_LOAD_POLICY": "wait_complete",
            "HICACHE_REMOTE_NEGATIVE_TTL_S": "0", **more}


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


def ask(client, keys: list[bytes], until: str = "complete") -> dict:
    """A match as the engine's client makes it (raw calls on its connection): while the
    reply says a remote lookup is pending, or a disk or remote part is still below the
    host, `load` with `until`. Returns the last reply, the match's pin still held."""
    r = client.conn.call("match", {"engine": client.engine_id, "keys": b"".join(keys)}, timeout_s=30.0)
    if r.get("pending") or r["disk_len"]:
        r = {**r, "pending": False, **client.conn.call("load", {"pin": r["pin"], "until": until}, timeout_s=30.0)}
    return r


def fetch_remote(cache, toks) -> int:
    """Ask for `toks` as an engine's client that waits for its lookups does, then let go of
    the match: pages the store held are now on this daemon's host. Returns the host pages
    the answer named (its device pages given back first, so every page counts)."""
    cache.evict(cache.pool.num_pages)
    r = ask(cache.client, cache.client.page_keys(toks))
    assert not r.get("pending"), r  # `until=complete` answers once every lookup ended
    cache.client.conn.call("release", {"pin": r["pin"]}, timeout_s=30.0)
    return len(r["host_pages"]) // 4


def load_remote(cache, toks) -> int:
    """The pages of `toks` an engine that waits for its lookups gets (fetch_remote), then
    loaded back from host, each checked byte for byte (load_exact, asking for those pages
    only: no second remote lookup of the rest)."""
    from tests.daemon.test_isolation import load_exact

    fetched = fetch_remote(cache, toks)
    assert load_exact(cache, toks[:fetched * cache.page_size]) == fetched
    return fetched


def dump(socket: str) -> str:
    return json.dumps(admin(socket, "stats"))


def elapsed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
