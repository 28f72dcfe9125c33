"""Disk admission through a real daemon: once the disk is full, a page is written only
when it is expected back (hicache/index/admission.py)."""

from __future__ import annotations

import pytest

from hicache.client.connection import RpcConnection
from hicache.config import Config
from hicache.errors import ConfigError
from tests.daemon.test_cycle import run_worker
from tests.wait import wait_until

FLOOD = [f"store:{seed}:160" for seed in range(1, 61)]  # 60 one-shot prompts of 40 pages


def disk_stats(socket: str) -> dict:
    conn = RpcConnection.connect(socket, timeout_s=30)
    conn.hello()
    assert conn.call("settle", {"timeout_s": 30})["settled"]
    st = conn.call("stats")["tiers"]["disk"]
    conn.close()
    return st


def flood_after_a_reused_prompt(daemon_factory, admission: str) -> tuple[dict, dict, int]:
    """store 100 twice -- 60 one-shot prompts -- load 100: (disk stats before the load,
    the load's result, pages the load read from disk)."""
    d = daemon_factory("--host-capacity", "1MiB", "--disk-capacity", "1MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_DISK_ADMISSION": admission}).start()
    run_worker(d.socket, "store:100:160", "store:100:160")  # seen twice: reused
    run_worker(d.socket, *FLOOD)  # far more than host (1 MiB) and disk (1 MiB) hold
    st = disk_stats(d.socket)
    (back,) = run_worker(d.socket, "load:100:160")
    from_disk = disk_stats(d.socket)["prefetched_pages"] - st["prefetched_pages"]
    d.stop()
    return st, back, from_disk


def test_a_full_disk_takes_the_reused_prompt_and_turns_one_shot_prompts_away(daemon_factory):
    st, back, from_disk = flood_after_a_reused_prompt(daemon_factory, "reuse")
    adm = st["admission"]
    assert adm["mode"] == "reuse" and adm["rejected_pages"] > 0 and adm["admitted_pages"] > 0
    # the reused prompt outlived the flood on disk and comes back from there byte-exact
    assert back["loaded"] == 40 and back["bad_pages"] == 0, back
    assert from_disk == 40

    st_all, _, _ = flood_after_a_reused_prompt(daemon_factory, "all")
    assert st_all["admission"]["rejected_pages"] == 0
    # the pages turned away were never written: fewer bytes went to LMDB
    assert st["bytes_written"] < st_all["bytes_written"]


def test_bad_admission_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="disk_admission"):
        Config(state_dir=tmp_path, disk_admission="sometimes")
    with pytest.raises(ConfigError, match="disk_placement"):
        Config(state_dir=tmp_path, disk_placement="mirror")


def test_non_inclusive_placement_writes_a_page_only_as_the_host_evicts_it(daemon_factory):
    d = daemon_factory("--host-capacity", "1MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_DISK_PLACEMENT": "non-inclusive"}).start()
    run_worker(d.socket, "store:7:160")
    st = disk_stats(d.socket)
    assert st["placement"] == "non-inclusive" and st["bytes_written"] == 0  # on host only: no write-through
    run_worker(d.socket, *FLOOD)  # 2400 one-shot pages push 7 out of the 1 MiB host
    st = disk_stats(d.socket)
    assert st["demoted_pages"] >= 40 and st["bytes_written"] > 0
    (back,) = run_worker(d.socket, "load:7:160")
    assert back["loaded"] == 40 and back["bad_pages"] == 0, back
    assert disk_stats(d.socket)["prefetched_pages"] - st["prefetched_pages"] == 40


def test_exclusive_placement_moves_a_page_read_back_off_the_disk_and_down_again(daemon_factory):
    d = daemon_factory("--host-capacity", "1MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_DISK_PLACEMENT": "exclusive"}).start()
    run_worker(d.socket, "store:7:160")
    run_worker(d.socket, *FLOOD)  # 7 goes down to disk as the host evicts it
    before = disk_stats(d.socket)
    assert before["bytes_written"] > 0 and before["promoted_pages"] == 0
    (back,) = run_worker(d.socket, "load:7:160")
    assert back["loaded"] == 40 and back["bad_pages"] == 0, back
    after = disk_stats(d.socket)
    assert after["prefetched_pages"] - before["prefetched_pages"] == 40
    # read back to host, its disk copy is gone (a leaf: nothing below it on disk)
    assert after["promoted_pages"] == 40
    page_bytes = 768  # tests/daemon/engine_worker.py's mha layout

    def deleted() -> bool:  # the load's own host evictions wrote other pages down meanwhile
        st = disk_stats(d.socket)
        return st["pages"] == before["pages"] + (st["bytes_written"] - before["bytes_written"]) // page_bytes - 40
    wait_until(deleted, what="the disk copy deleted")
    run_worker(d.socket, *[f"store:{seed}:160" for seed in range(200, 260)])  # a second flood
    again = disk_stats(d.socket)
    (back,) = run_worker(d.socket, "load:7:160")  # written down again, and read back again
    assert back["loaded"] == 40 and back["bad_pages"] == 0, back
    assert disk_stats(d.socket)["prefetched_pages"] - again["prefetched_pages"] == 40


def test_lookups_of_an_engine_that_stores_by_puts_teach_the_admission(daemon_factory):
    """vLLM-style engines store by puts and never insert whole requests: their lookups are what
    the admission counts. A prompt looked up twice is taken by the full disk as the host evicts
    it, and loads back from there bit-exact, while one-shot prompts are turned away."""
    import numpy as np

    from hicache.client.client import HiCacheClient
    from hicache.layout import KVLayout

    layout = KVLayout("mha", num_layers=2, page_size=16, dtype="float16", num_kv_heads=4, head_dim=64)
    pb = layout.page_bytes  # 32 KiB: 32 pages fill the 1 MiB host tier
    d = daemon_factory("--host-capacity", "1MiB", "--disk-capacity", "1MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_DISK_ADMISSION": "reuse"}).start()
    c = HiCacheClient(layout, 64, model="m", socket_path=d.socket, timeout_s=30.0)
    assert c.connect()
    admin = RpcConnection.connect(d.socket, timeout_s=60)
    admin.hello()

    def prompt(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 30000, 8 * 16, dtype=np.int32)  # 8 pages

    def serve(seed: int) -> None:  # what the vLLM connector does for a request: look up, store the rest
        toks = prompt(seed)
        c.release(c.match(toks))
        plan = c.put(toks)
        if plan is None or plan.put is None:
            return
        assert c.arena is not None
        for i, slot in enumerate(plan.host_pages):
            c.arena.array[slot * pb:(slot + 1) * pb] = (seed * 31 + plan.present + i) % 251
        assert c.put_done(plan) is not None
        # the disk writes of this request end before the next one: a write in flight keeps its
        # pages HOST-locked, so how far the flood evicts would follow the writer thread's speed
        assert admin.call("settle", {"timeout_s": 30})["settled"]

    for seed in range(1, 21):  # one-shot prompts fill the disk while it has room
        serve(seed)
    serve(100)
    serve(100)  # looked up twice: reused
    for seed in range(21, 61):  # more one-shot prompts push 100 off the host
        serve(seed)
    st = disk_stats(d.socket)
    assert st["admission"]["rejected_pages"] > 0
    m = c.match(prompt(100))
    assert m.host_len == 8, (m.host_len, m.disk_len)  # brought back from disk (wait_complete)
    assert m.from_disk == 8
    for i, slot in enumerate(m.host_pages):
        assert (c.arena.array[slot * pb:(slot + 1) * pb] == (100 * 31 + i) % 251).all()
    c.release(m)
    c.close()
    admin.close()
