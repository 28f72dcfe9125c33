"""hicache as SGLang's L3 (hicache.integrations.sglang), against SGLang's real storage config,
dynamic backend factory, key function and host pools, and real daemon processes."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch

from tests.integrations.sglang_util import (
    PAGE_SIZE, StorageBackendFactory, HiCacheStorage, backend, content, fill, host_pool, matches, page_keys,
    run_instance, storage_config,
)
from tests.daemon.disk_faults_util import free_port, metrics_text
from tests.wait import events_until_quiet, wait_until

from hicache.client.async_client import AsyncRpcConnection
from hicache.client.connection import RpcConnection
from hicache.client.keyed import named_page
from hicache.errors import ConfigError
from hicache.integrations.sglang import HiCacheStore
from hicache.tiers.disk import format as fmt

DISK = ("--host-capacity", "64MiB", "--disk-capacity", "256MiB")


def admin(sock: str, method: str, params: dict | None = None) -> dict:
    return RpcConnection.one_call(sock, method, params or {}, timeout_s=5.0)


def sentinel(pool, idx: torch.Tensor) -> None:
    fill(pool, idx, seed=999)  # bytes no stored page has: a miss must leave them


def page_at(pool, idx: torch.Tensor, i: int) -> torch.Tensor:
    return pool.get_data_page(int(idx[i * PAGE_SIZE]), flat=True).view(torch.uint8).clone()


# ------------------------------------------------------------------ construction

def test_sglangs_dynamic_factory_builds_the_backend(daemon):
    pool = host_pool()
    b = backend(daemon.socket, pool)
    assert isinstance(b, HiCacheStore) and isinstance(b, HiCacheStorage)
    b.close()
    assert b.batch_exists(["k"]) == 0 and b.batch_set_v1([], pool.alloc(0)) == []  # closed: misses
    with pytest.raises(ValueError, match="model"):
        StorageBackendFactory.create_backend("dynamic", storage_config(daemon.socket, model=None), pool)
    from hicache.integrations.sglang_cpu import mha_host_pool
    tiny = mha_host_pool(layers=1, heads=1, head_dim=8, page_size=2, pages=4, layout="page_first")
    b = StorageBackendFactory.create_backend("dynamic", storage_config(daemon.socket), tiny)
    with pytest.raises(ValueError, match="page-size >= 4"):
        b.register_mem_pool_host(tiny)


# ------------------------------------------------------------------ the proof: processes, restart

@pytest.mark.slow
def test_two_instances_share_pages_and_a_restarted_daemon_serves_them_from_disk(daemon_factory):
    d = daemon_factory(*DISK).start()
    n = 40
    assert run_instance(d.socket, "store", str(n), "7") == {"stored": [True] * n}
    b = run_instance(d.socket, "load", str(n), "7")  # a second SGLang instance
    assert b == {"exists": n, "got": [True] * n, "exact": [True] * n}
    d.stop()  # SIGTERM: the disk queue is flushed first
    d.start()
    c = run_instance(d.socket, "load", str(n), "7")  # a third, after the restart: from disk
    assert c == {"exists": n, "got": [True] * n, "exact": [True] * n}
    assert admin(d.socket, "stats")["tiers"]["disk"]["prefetched_pages"] >= n


# ------------------------------------------------------------------ bytes and layouts

LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
           ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_pages_round_trip_bit_exact_between_instances(daemon, kind, layout):
    p1, p2 = host_pool(kind, layout), host_pool(kind, layout)
    b1, b2 = backend(daemon.socket, p1, mla=kind == "mla"), backend(daemon.socket, p2, mla=kind == "mla")
    keys = page_keys(12, seed=1)
    src = p1.alloc(12 * PAGE_SIZE)
    fill(p1, src, seed=1)
    assert b1.batch_set_v1(keys, src) == [True] * 12
    p2.alloc(5 * PAGE_SIZE)  # other slots than the writer's
    dst = p2.alloc(12 * PAGE_SIZE)
    sentinel(p2, dst)
    assert b2.batch_exists(keys) == 12
    assert b2.batch_get_v1(keys, dst) == [True] * 12
    assert matches(p2, dst, seed=1) == [True] * 12
    # the tensor API reads and writes the same pages (SGLang's flat data page)
    flat = b2.get(keys[4])
    assert torch.equal(flat.view(torch.uint8).reshape(-1), content(p1, 1, 4).view(torch.uint8))
    extra = page_keys(1, seed=2)
    assert b2.set(extra[0], content(p2, 2, 0)) and b1.exists(extra[0])
    one = p1.alloc(PAGE_SIZE)
    assert b1.batch_get_v1(extra, one) == [True] and matches(p1, one, seed=2) == [True]
    b1.close()
    b2.close()


def test_exists_counts_the_leading_run_and_get_answers_per_key(daemon):
    p1, p2 = host_pool(), host_pool()
    b1, b2 = backend(daemon.socket, p1), backend(daemon.socket, p2)
    keys = page_keys(8, seed=3)
    src = p1.alloc(8 * PAGE_SIZE)
    fill(p1, src, seed=3)
    stored = [0, 1, 3, 4, 5, 6, 7]  # page 2 never stored
    assert b1.batch_set_v1([keys[i] for i in stored], torch.cat([src[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
                                                                  for i in stored])) == [True] * 7
    assert b2.batch_exists(keys) == 2
    assert b2.batch_exists(keys[3:]) == 5  # SGLang asks from the middle of a prefix
    assert b2.batch_exists(page_keys(3, seed=3, prior=keys[-1])) == 0  # its continuation: not stored
    assert b2.batch_exists([]) == 0 and not b2.exists("no-such-key")
    dst = p2.alloc(8 * PAGE_SIZE)
    sentinel(p2, dst)
    before = page_at(p2, dst, 2)
    assert b2.batch_get_v1(keys, dst) == [True, True, False, True, True, True, True, True]
    assert matches(p2, dst, seed=3) == [True, True, False, True, True, True, True, True]
    assert torch.equal(page_at(p2, dst, 2), before)  # the miss left page 2 alone
    assert b2.batch_get([keys[2], keys[3]])[0] is None
    assert b1.batch_set_v1(keys[:2], src[:2 * PAGE_SIZE]) == [True, True]  # stored already: still success
    b1.close()
    b2.close()


def test_namespaces_isolate_models_ranks_layouts_and_salts(daemon):
    sock = daemon.socket
    pool = host_pool()
    keys = page_keys(4, seed=4)
    idx = pool.alloc(4 * PAGE_SIZE)
    fill(pool, idx, seed=4)
    writer = backend(sock, pool, tp_rank=0, tp_size=2)
    assert writer.batch_set_v1(keys, idx) == [True] * 4
    others = [backend(sock, host_pool(), tp_rank=1, tp_size=2),  # MHA pages are per rank
              backend(sock, host_pool(), model="other-model", tp_rank=0, tp_size=2),
              backend(sock, host_pool("mha", "layer_first"), tp_rank=0, tp_size=2),
              backend(sock, host_pool(), tp_rank=0, tp_size=1),
              backend(sock, host_pool(), tp_rank=0, tp_size=2, namespace="lora-7")]
    assert [o.batch_exists(keys) for o in others] == [0, 0, 0, 0, 0]
    same = backend(sock, host_pool(), tp_rank=0, tp_size=2)
    assert same.batch_exists(keys) == 4
    for b in [writer, same, *others]:
        b.close()


def test_mla_pages_are_one_copy_for_every_tp_rank(daemon):
    sock = daemon.socket
    p0, p1 = host_pool("mla"), host_pool("mla")
    r0 = backend(sock, p0, mla=True, tp_rank=0, tp_size=2)
    r1 = backend(sock, p1, mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(6, seed=5)
    i0, i1 = p0.alloc(6 * PAGE_SIZE), p1.alloc(6 * PAGE_SIZE)
    fill(p0, i0, seed=5)
    fill(p1, i1, seed=5)
    assert r1.batch_set_v1(keys, i1) == [True] * 6  # not the storage writer: rank 0's copy serves it
    assert r0.batch_exists(keys) == 0
    assert r0.batch_set_v1(keys, i0) == [True] * 6
    sentinel(p1, i1)
    assert r1.batch_exists(keys) == 6 and r1.batch_get_v1(keys, i1) == [True] * 6
    assert matches(p1, i1, seed=5) == [True] * 6
    r0.close()
    r1.close()


# ------------------------------------------------------------------ faults

def test_a_stopped_or_hung_daemon_is_a_prompt_miss_and_the_backend_recovers(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk").start()
    pool = host_pool()
    b = backend(d.socket, pool)
    keys = page_keys(8, seed=6)
    idx = pool.alloc(8 * PAGE_SIZE)
    fill(pool, idx, seed=6)
    assert b.batch_set_v1(keys, idx) == [True] * 8

    def thirty_calls() -> float:
        t0 = time.monotonic()
        for _ in range(10):
            assert b.batch_exists(keys) == 0
            assert b.batch_get_v1(keys, idx) == [False] * 8
            assert b.batch_set_v1(keys, idx) == [False] * 8
        return time.monotonic() - t0

    d.proc.send_signal(signal.SIGSTOP)  # hung: accepts nothing, answers nothing
    try:
        assert thirty_calls() < 3.0  # one deadline (0.5 s) for the first, then the open breaker
    finally:
        d.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: b.batch_exists(keys) == 8, 30, "the backend reconnected to the resumed daemon")
    assert matches(pool, idx, seed=6) == [True] * 8  # the failed gets wrote nothing

    d.kill9()
    assert thirty_calls() < 3.0
    late = backend(d.socket, host_pool())  # an instance starting while the daemon is down
    assert late.batch_exists(keys) == 0
    d.start()
    wait_until(lambda: b.batch_set_v1(keys, idx) == [True] * 8, 30, "stores work again after the restart")
    wait_until(lambda: late.batch_exists(keys) == 8, 30, "the late instance found the daemon")
    b.close()
    late.close()


def test_a_page_corrupted_on_disk_is_a_miss_never_data(daemon_factory):
    d = daemon_factory(*DISK).start()
    p1, p2 = host_pool(), host_pool()
    b1, b2 = backend(d.socket, p1), backend(d.socket, p2)
    keys = page_keys(6, seed=9)
    src = p1.alloc(6 * PAGE_SIZE)
    fill(p1, src, seed=9)
    assert b1.batch_set_v1(keys, src) == [True] * 6
    wait_until(lambda: admin(d.socket, "stats")["tiers"]["disk"]["pages"] == 6
               and admin(d.socket, "stats")["tiers"]["disk"]["queue_depth"] == 0, 60, "6 pages on disk")
    admin(d.socket, "flush", {"tier": "host"})  # the next read comes from disk
    # flip a byte in the middle of page 2's record, under the running daemon's map
    key2 = named_page(b1.salt, keys[2].encode(), PAGE_SIZE)[0]
    disk = Path(d.state_dir) / "disk"
    env = lmdb.open(str(disk), readonly=True, max_dbs=4, lock=True)
    try:
        with env.begin(db=env.open_db(fmt.DB_PAGES, create=False)) as txn:
            records = {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()
    (record,) = [v for k, v in records.items() if key2 in k]
    blob = (disk / "data.mdb").read_bytes()
    at = blob.find(record) + len(record) // 2
    assert at > len(record) // 2
    with open(disk / "data.mdb", "r+b") as f:
        f.seek(at)
        f.write(bytes([blob[at] ^ 0xFF]))
    dst = p2.alloc(6 * PAGE_SIZE)
    sentinel(p2, dst)
    before = page_at(p2, dst, 2)
    assert b2.batch_exists(keys) == 6  # the index still lists it: only a read can tell
    assert b2.batch_get_v1(keys, dst) == [True, True, False, True, True, True]
    assert matches(p2, dst, seed=9) == [True, True, False, True, True, True]
    assert torch.equal(page_at(p2, dst, 2), before)  # not one byte of the corrupt page served
    assert admin(d.socket, "stats")["tiers"]["disk"]["corrupt_pages"] == 1
    assert b2.batch_exists(keys) == 2  # and it is gone
    b1.close()
    b2.close()


def test_bad_input_is_a_clear_error(daemon):
    pool = host_pool()
    b = backend(daemon.socket, pool)
    keys = page_keys(2, seed=10)
    idx = pool.alloc(2 * PAGE_SIZE)
    with pytest.raises(ValueError, match="host indices"):
        b.batch_set_v1(keys, idx[:-1])
    with pytest.raises(ValueError, match="whole pages"):
        b.batch_get_v1(keys, idx + 1)
    with pytest.raises(ValueError, match="bytes"):
        b.set(keys[0], torch.zeros(3))
    b.close()


# ------------------------------------------------------------------ concurrency and round trips

def test_sglangs_threads_run_at_once_with_one_round_trip_per_batch(daemon, monkeypatch):
    calls: list[str] = []
    real_call = RpcConnection.call

    def counted(self, method, *args, **kwargs):
        calls.append(method)
        return real_call(self, method, *args, **kwargs)

    p1, p2 = host_pool(pages=5 * 128 + 8), host_pool(pages=5 * 128 + 8)
    b1, b2 = backend(daemon.socket, p1), backend(daemon.socket, p2)
    monkeypatch.setattr(RpcConnection, "call", counted)
    keys = page_keys(128, seed=11)
    src = p1.alloc(128 * PAGE_SIZE)
    fill(p1, src, seed=11)
    calls.clear()
    assert b1.batch_set_v1(keys, src) == [True] * 128
    # map_slabs: the namespace grew into new host slabs (1 MiB each here), which this
    # connection maps once; per slab, never per page
    assert [c for c in calls if c != "map_slabs"] == ["store", "store_done"] and calls.count("map_slabs") <= 3
    calls.clear()
    assert b2.batch_exists(keys) == 128
    assert calls == ["exists"]
    dst = p2.alloc(128 * PAGE_SIZE)
    calls.clear()
    assert b2.batch_get_v1(keys, dst) == [True] * 128
    assert [c for c in calls if c != "map_slabs"] == ["fetch", "release"] and calls.count("map_slabs") <= 3

    # prefetch, backup and IO threads at once: each its own connection, each batch exact
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            ks = page_keys(128, seed=seed)
            a, z = p1.alloc(128 * PAGE_SIZE), p2.alloc(128 * PAGE_SIZE)
            fill(p1, a, seed=seed)
            for _ in range(3):
                assert b1.batch_set_v1(ks, a) == [True] * 128
                assert b2.batch_exists(ks) == 128
                assert b2.batch_get_v1(ks, z) == [True] * 128
                assert matches(p2, z, seed=seed) == [True] * 128
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(100 + t,)) for t in range(2)]
    for t in threads:
        t.start()
    worker(102)
    for t in threads:
        t.join(120)
    assert not errors, errors
    b1.close()
    b2.close()


def test_the_first_store_finds_its_host_slabs_mapped_at_registration(daemon, monkeypatch):
    """The backend names SGLang's storage batch when it registers: the daemon keeps that
    room in spare slabs, mapped (and pre-faulted) here before the first batch_set_v1,
    whose copy then waits for no map_slabs; the next spares are mapped after it."""
    calls: list[str] = []
    real_call = RpcConnection.call

    def counted(self, method, *args, **kwargs):
        calls.append(method)
        return real_call(self, method, *args, **kwargs)

    pool = host_pool(pages=2 * 128 + 8)
    b = backend(daemon.socket, pool)
    host = admin(daemon.socket, "stats")["tiers"]["host"]
    assert host["pages"] == 0 and host["spare_slabs"] > 0  # room, and no page in it
    monkeypatch.setattr(RpcConnection, "call", counted)
    keys, src = page_keys(128, seed=5), pool.alloc(128 * PAGE_SIZE)
    fill(pool, src, seed=5)
    assert b.batch_set_v1(keys, src) == [True] * 128
    assert calls[:2] == ["store", "store_done"] and set(calls[2:]) <= {"map_slabs"}
    monkeypatch.undo()
    dst = pool.alloc(128 * PAGE_SIZE)
    assert b.batch_get_v1(keys, dst) == [True] * 128 and matches(pool, dst, seed=5) == [True] * 128
    b.close()


# ------------------------------------------------------------------ what a real server showed (issue 27)

def test_sglang_traffic_feeds_stats_metrics_and_events(daemon_factory):
    """Keyed pages count like any other: lookups, hit rate, loads, puts, metrics, events."""
    port = free_port()
    d = daemon_factory("--host-capacity", "64MiB", "--no-disk", "--metrics-port", str(port)).start()
    p1, p2 = host_pool(), host_pool()
    b1, b2 = backend(d.socket, p1), backend(d.socket, p2)
    keys = page_keys(6, seed=12)
    more = page_keys(4, seed=13, prior=keys[-1])

    def traffic() -> None:
        src = p1.alloc(6 * PAGE_SIZE)
        fill(p1, src, seed=12)
        assert b1.batch_set_v1(keys, src) == [True] * 6
        assert b2.batch_exists(keys + more) == 6  # 10 asked for, the first 6 on host
        assert b2.batch_get_v1(keys, p2.alloc(6 * PAGE_SIZE)) == [True] * 6

    async def watched() -> list[dict]:
        sub = await AsyncRpcConnection.connect(d.socket)
        await sub.subscribe()
        await asyncio.to_thread(traffic)
        return await events_until_quiet(sub)

    events = asyncio.run(watched())
    stored = [k for e in events if e["type"] == "stored" and e["tier"] == "host" for k in e["keys"]]
    assert sorted(stored) == sorted(named_page(b1.salt, k.encode(), PAGE_SIZE)[0] for k in keys)
    st = admin(d.socket, "stats")
    assert st["requests"]["matches"] == 1 and st["requests"]["requested_pages"] == 10
    assert st["requests"]["loaded_pages"] == 6
    assert st["tiers"]["host"]["hit_rate"] == pytest.approx(0.6)
    assert (st["puts"]["puts"], st["puts"]["put_pages"], st["puts"]["committed_pages"]) == (1, 6, 6)
    wait_until(lambda: re.search(r'hicache_hits_total\{tier="host"\} 6\.0', metrics_text(port))
               and re.search(r"hicache_misses_total 4\.0", metrics_text(port)), 30, "hits and misses in the metrics")
    b1.close()
    b2.close()


def engines_of(sock: str) -> int:
    return len(admin(sock, "stats")["engines"])


def test_restarted_sglang_threads_reuse_connections_instead_of_leaking_them(daemon):
    """/flush_cache makes SGLang stop its storage threads and start new ones (HiCacheController.reset),
    without telling the backend: connections must not pile up, and a new thread's first call
    must not open one (a connect on the prefetch path could outlast SGLang's prefetch timeout)."""
    pool = host_pool()
    b = backend(daemon.socket, pool)
    keys = page_keys(4, seed=14)
    src = pool.alloc(4 * PAGE_SIZE)
    fill(pool, src, seed=14)
    assert b.batch_set_v1(keys, src) == [True] * 4
    dst = pool.alloc(4 * PAGE_SIZE)
    opened = engines_of(daemon.socket)
    errors: list[BaseException] = []

    def storage_thread(kind: str) -> None:  # what SGLang's prefetch / IO / backup threads call
        try:
            for _ in range(3):
                if kind == "prefetch":
                    assert b.batch_exists(keys) == 4
                elif kind == "io":
                    assert b.batch_get_v1(keys, dst) == [True] * 4
                else:
                    assert b.batch_set_v1(keys, src) == [True] * 4
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for _ in range(5):  # five flushes: the threads stop and are replaced each time
        threads = [threading.Thread(target=storage_thread, args=(k,)) for k in ("prefetch", "io", "backup")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert engines_of(daemon.socket) <= 3  # at most one per concurrent caller, whatever the flushes
    calls: list[str] = []
    real_call = RpcConnection.call

    def counted(self, method, *args, **kwargs):
        calls.append(method)
        return real_call(self, method, *args, **kwargs)

    RpcConnection.call = counted
    try:
        t = threading.Thread(target=lambda: calls.append(str(b.batch_exists(keys))))
        t.start()
        t.join(30)
    finally:
        RpcConnection.call = real_call
    assert calls == ["exists", "4"]  # a new thread's first call: no connect, no registration
    b.close()
    assert engines_of(daemon.socket) == 0 and opened >= 1


def test_the_extra_config_model_names_the_namespace_whatever_the_model_path(daemon):
    """SGLang passes its served model name (--model-path unless --served-model-name is given):
    the extra-config "model" overrides it, so one model at two paths shares its pages."""
    sock = daemon.socket
    p1, p2 = host_pool(), host_pool()
    a = backend(sock, p1, model="/mnt/node-a/llama", model_extra="tiny-llama")
    b = backend(sock, p2, model="/mnt/node-b/llama", model_extra="tiny-llama")
    other = backend(sock, host_pool(), model="/mnt/node-b/llama")  # no override: the path names it
    keys = page_keys(3, seed=15)
    src = p1.alloc(3 * PAGE_SIZE)
    fill(p1, src, seed=15)
    assert a.batch_set_v1(keys, src) == [True] * 3
    assert b.batch_exists(keys) == 3 and other.batch_exists(keys) == 0
    dst = p2.alloc(3 * PAGE_SIZE)
    assert b.batch_get_v1(keys, dst) == [True] * 3 and matches(p2, dst, seed=15) == [True] * 3
    assert {e["model"] for e in admin(sock, "stats")["engines"]} == {"tiny-llama", "/mnt/node-b/llama"}
    for x in (a, b, other):
        x.close()


def test_the_extra_config_deadlines_reach_every_connection_and_bad_ones_are_refused(daemon):
    b = backend(daemon.socket, host_pool(), deadlines={"match_s": 3.0})
    keys = page_keys(2, seed=16)
    assert b.batch_exists(keys) == 0  # a call opened the pooled connection with them
    assert {c.deadlines.match_s for c in b._clients} == {3.0}
    assert {c.deadlines.load_s for c in b._clients} == {2.0}  # the backend's own default kept
    b.close()
    with pytest.raises(ConfigError, match="unknown deadline"):
        storage = storage_config(daemon.socket, deadlines={"lookup": 1.0})
        StorageBackendFactory.create_backend("dynamic", storage, host_pool())
