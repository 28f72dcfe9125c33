"""Host puts (hicache/daemon/ingest/puts.py) against a real daemon: an engine with its own
device cache stores pages straight into the host tier, another engine of the
namespace reads them back bit-exact, and nothing leaks when a put is never finished."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache.client.client import HiCacheClient
from hicache.errors import ClientError
from hicache.layout import KVLayout
from tests.wait import wait_until

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)
PB = LAYOUT.page_bytes


def client(d, model: str = "m", **kw) -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model=model, socket_path=d.socket, timeout_s=10.0, **kw)
    assert c.connect()
    return c


def page_bytes(key: bytes) -> np.ndarray:
    return np.frombuffer((key * (PB // len(key) + 1))[:PB], dtype=np.uint8)


def write(c: HiCacheClient, keys: list[bytes], pages: np.ndarray) -> None:
    assert c.arena is not None and c.arena.covers(pages, PB)
    for key, slot in zip(keys, pages):
        c.arena.array[slot * PB:(slot + 1) * PB] = page_bytes(key)


def read(c: HiCacheClient, pages: np.ndarray) -> list[bytes]:
    assert c.arena is not None and c.arena.covers(pages, PB)
    return [c.arena.array[s * PB:(s + 1) * PB].tobytes() for s in pages]


def host_pages(c: HiCacheClient) -> int:
    return c.stats()["tiers"]["host"]["pages"]


def test_put_then_another_engine_reads_bit_exact(daemon):
    a, b = client(daemon), client(daemon)
    toks = np.arange(40, dtype=np.int32)  # 10 pages
    keys = a.page_keys(toks)
    plan = a.put(toks)
    assert plan is not None and plan.put is not None and plan.present == 0 and len(plan.host_pages) == 10
    assert b.match(toks).host_len == 0  # reserved is not stored
    write(a, keys, plan.host_pages)
    assert a.put_done(plan) == 10
    m = b.match(toks)
    assert m.device_len == 0 and m.host_len == 10
    assert read(b, m.host_pages) == [page_bytes(k).tobytes() for k in keys]
    b.release(m)
    # a longer prefix: only the new pages are reserved, and they hang below the stored ones
    toks2 = np.arange(60, dtype=np.int32)
    keys2 = a.page_keys(toks2)
    plan2 = a.put(toks2)
    assert plan2.present == 10 and len(plan2.host_pages) == 5
    write(a, keys2[10:], plan2.host_pages)
    assert b.put_done(plan2.__class__(plan2.put, plan2.present, plan2.host_pages, plan2.slabs, b.epoch)) == 5
    m = b.match(toks2)
    assert m.host_len == 15 and read(b, m.host_pages) == [page_bytes(k).tobytes() for k in keys2]
    # everything present: nothing to copy
    again = a.put(toks2)
    assert again.put is None and again.present == 15
    a.close(), b.close()


def test_failed_put_stores_nothing_and_frees_its_pages(daemon):
    a = client(daemon)
    toks = np.arange(32, dtype=np.int32)
    plan = a.put(toks)
    assert host_pages(a) == 8  # reserved
    assert a.put_done(plan, ok=False) == 0
    assert a.match(toks).host_len == 0
    assert host_pages(a) == 0
    a.close()


def test_only_the_namespace_may_finish_a_put(daemon):
    a, other = client(daemon), client(daemon, model="other")
    plan = a.put(np.arange(16, dtype=np.int32))
    with pytest.raises(ClientError) as e:
        other.conn.call("put_done", {"engine": other.engine_id, "put": plan.put, "ok": True})
    assert e.value.code == "NOT_FOUND"
    assert a.put_done(plan) == 4  # still pending, still ours
    a.close(), other.close()


def test_bad_put_changes_nothing(daemon):
    a = client(daemon)
    keys = a.page_keys(np.arange(16, dtype=np.int32))
    with pytest.raises(ClientError) as e:
        a.conn.call("put", {"engine": a.engine_id, "keys": b"".join(keys), "tokens": b"\0" * 12})
    assert e.value.code == "BAD_PARAMS"
    assert host_pages(a) == 0 and a.stats()["puts"]["pending"] == 0
    a.close()


def test_unfinished_put_expires(daemon_factory, tmp_path):
    cfg = tmp_path / "h.toml"
    cfg.write_text("put_lease_s = 0.2\n")
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk", "--config", str(cfg)).start()
    a = client(d)
    plan = a.put(np.arange(16, dtype=np.int32))
    assert plan.put is not None
    # leases are checked as puts come in: keep offering an unrelated page until the first is gone
    wait_until(lambda: a.put(np.arange(100, 104, dtype=np.int32)) is not None
               and a.stats()["puts"]["expired"] >= 1, 30, "the lease to expire")
    with pytest.raises(ClientError) as e:
        a.conn.call("put_done", {"engine": a.engine_id, "put": plan.put, "ok": True})
    assert e.value.code == "NOT_FOUND"
    a.close()


def test_a_put_outlives_its_engines_until_its_lease(daemon_factory, tmp_path):
    """The last engine of a namespace disconnecting does not free its pending put: a worker whose
    connection dropped may still be copying into those pages. The lease frees them, with no
    other put arriving to check it."""
    lease_s = 2.0
    cfg = tmp_path / "h.toml"
    cfg.write_text(f"put_lease_s = {lease_s}\n")
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk", "--config", str(cfg)).start()
    a = client(d)
    t0 = time.monotonic()
    assert a.put(np.arange(16, dtype=np.int32)).put is not None
    a.close()
    watcher = client(d, model="watcher")
    pending = watcher.stats()["puts"]["pending"]
    assert pending == 1 or time.monotonic() - t0 >= lease_s, "the put was freed before its lease"
    wait_until(lambda: watcher.stats()["puts"]["pending"] == 0 and host_pages(watcher) == 0, 30,
               "the lease to free the put's pages")
    assert watcher.stats()["puts"]["expired"] == 1
    watcher.close()


def test_put_pages_reach_disk_and_survive_a_restart(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "64MiB").start()
    a = client(d)
    toks = np.arange(24, dtype=np.int32)
    keys = a.page_keys(toks)
    plan = a.put(toks)
    write(a, keys, plan.host_pages)
    a.put_done(plan)
    wait_until(lambda: a.stats()["tiers"]["disk"]["pages"] == 6, 30, "the disk write")
    a.close()
    d.stop()
    d.start()
    b = client(d)
    m = wait_until(lambda: (lambda m: m if m.host_len == 6 else b.release(m))(b.match(toks)), 30,
                   "the pages to come back from disk")
    assert read(b, m.host_pages) == [page_bytes(k).tobytes() for k in keys]
    b.close()


def test_stats_cli_shows_puts(daemon):
    import subprocess
    import sys

    a = client(daemon)
    toks = np.arange(8, dtype=np.int32)
    plan = a.put(toks)
    write(a, a.page_keys(toks), plan.host_pages)
    a.put_done(plan)
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "stats", "--socket", daemon.socket],
                         capture_output=True, text=True, timeout=60).stdout
    assert "puts 1 (2 pages stored)  pending 0" in out
    a.close()
