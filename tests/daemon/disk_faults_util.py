"""Helpers for the disk-fault tests: stats, polling, tmpfs mounts, LMDB damage and
an event subscriber that records which pages the daemon acknowledged on disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from hicache.client.async_client import AsyncRpcConnection
from hicache.client.connection import RpcConnection
from hicache.tiers.disk import format as fmt
from tests.wait import wait_until

WAIT = {"HICACHE_LOAD_POLICY": "wait_complete"}


def stats(sock: str) -> dict:
    return RpcConnection.one_call(sock, "stats", None, timeout_s=5.0)


def admin(sock: str, method: str, params: dict | None = None) -> Any:
    return RpcConnection.one_call(sock, method, params or {}, timeout_s=5.0)


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `cond` until it returns something truthy; fail after `timeout_s`."""
    return wait_until(cond, timeout_s, what, interval_s=0.05)


def disk_settled(sock: str, min_pages: int = 1) -> dict | None:
    """The disk tier's stats once its write queue is empty and it holds >= min_pages."""
    d = stats(sock)["tiers"]["disk"]
    return d if d["queue_depth"] == 0 and d["pages"] >= min_pages else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only; the test is skipped otherwise).
    Unmounted lazily at the end, so a daemon still holding files cannot block it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_ro(path: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount {path} read-only: {r.stderr.strip()}")


def used_bytes_of(env_dir: Path) -> int:
    """Bytes of data.mdb in use (up to its last page), read through LMDB."""
    env = lmdb.open(str(env_dir), readonly=True, max_dbs=4, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def damage(data_file: Path, how: str) -> None:
    """Damage an LMDB data file the ways disks, copies and people do."""
    if how == "meta":  # both meta pages overwritten with random bytes
        with open(data_file, "r+b") as f:
            f.write(os.urandom(8192))
    elif how == "btree":  # random bytes over the B-tree pages after the meta pages
        used = used_bytes_of(data_file.parent)
        with open(data_file, "r+b") as f:
            f.seek(8192)
            f.write(os.urandom(max(4096, used - 8192)))
    elif how == "half":  # a copy cut short: half of the used pages
        used = used_bytes_of(data_file.parent)
        os.truncate(data_file, used // 2)
    elif how == "zero":
        os.truncate(data_file, 0)
    elif how == "garbage":  # some other file under the name
        data_file.write_bytes(os.urandom(1 << 20))
    else:
        raise ValueError(how)


def reachable_keys(env_dir: Path) -> tuple[dict[bytes, set[bytes]], int]:
    """Read the environment of a stopped daemon: per salt, the page keys reachable from
    the salt through parents that are on disk (what a rebuild restores), and the number
    of records that are not reachable."""
    env = lmdb.open(str(env_dir), readonly=True, max_dbs=4, lock=False)
    try:
        meta = env.open_db(fmt.DB_META, create=False)
        with env.begin(db=meta) as txn:
            recs = [fmt.unpack_record(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()
    children: dict[bytes, list[bytes]] = {}
    salts = set()
    for r in recs:
        assert r is not None, "malformed meta record"
        children.setdefault(r.parent_key if r.parent_key is not None else r.salt, []).append(r.key)
        salts.add(r.salt)
    out: dict[bytes, set[bytes]] = {}
    for salt in salts:
        seen: set[bytes] = set()
        stack = list(children.get(salt, []))
        while stack:
            k = stack.pop()
            seen.add(k)
            stack.extend(children.get(k, []))
        out[salt] = seen
    return out, len(recs) - sum(len(s) for s in out.values())


class DiskAcks:
    """Subscribes to the daemon's events on a thread and records, per namespace, the
    page keys acknowledged as on disk: a `stored` event of tier `disk` adds them, a
    `removed` event of tier `disk` (an eviction: gone on purpose) takes them out."""

    def __init__(self, sock: str) -> None:
        self.sock = sock
        self.keys: dict[str, set[bytes]] = {}
        self.total = 0  # acknowledgements received, evicted or not
        self.lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the event subscriber did not connect")

    async def _run(self) -> None:
        sub = await AsyncRpcConnection.connect(self.sock)
        await sub.subscribe()
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    ev = await asyncio.wait_for(sub.next_event(), 0.2)
                except asyncio.TimeoutError:
                    continue
                if ev.get("tier") == "disk" and ev.get("type") in ("stored", "removed"):
                    with self.lock:
                        keys = self.keys.setdefault(ev["namespace"], set())
                        if ev["type"] == "stored":
                            keys.update(ev["keys"])
                            self.total += len(ev["keys"])
                        else:
                            keys.difference_update(ev["keys"])
        except Exception:  # the daemon went away (kill -9): what arrived is what was acknowledged
            pass
        finally:
            with contextlib.suppress(Exception):
                await sub.close()

    def count(self) -> int:
        with self.lock:
            return self.total

    def snapshot(self) -> dict[str, set[bytes]]:
        with self.lock:
            return {ns: set(k) for ns, k in self.keys.items()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
