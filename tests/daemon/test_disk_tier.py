"""The disk tier through a real daemon: demotion, prefetch, persistence across restarts."""

from __future__ import annotations

from tests.daemon.test_cycle import run_worker


def test_pages_demoted_to_disk_come_back_byte_exact(daemon_factory):
    # a host tier of ~1 MiB holds 64 slabs of 16 KiB: a few pages of 768 B each ... so make it tight:
    d = daemon_factory("--host-capacity", "1MiB", "--disk-capacity", "256MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    # 12 conversations of 40 pages each: far more than the host tier holds
    ops = [f"store:{i}:160" for i in range(1, 13)]
    run_worker(d.socket, *ops)
    first = run_worker(d.socket, "load:1:160")[0]
    assert first["bad_pages"] == 0
    assert first["loaded"] == 40, first  # host + disk together cover the whole prefix
    assert first["disk_len"] == 0


def test_disk_pages_survive_a_restart(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "256MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    run_worker(d.socket, "store:7:64", "store:8:64")
    assert d.stop() == 0  # clean stop flushes the write queue
    d.start()
    (b,) = run_worker(d.socket, "load:7:64")
    assert b["loaded"] == 16 and b["bad_pages"] == 0 and b["host_len"] == 16


def test_disk_pages_survive_kill9(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "256MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    run_worker(d.socket, "store:9:64")
    # wait until the write-through committed, then kill -9
    import time

    from hicache.client.connection import RpcConnection
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        c = RpcConnection.connect(d.socket)
        c.hello()
        st = c.call("stats")
        c.close()
        if st["tiers"]["disk"]["pages"] >= 16 and st["tiers"]["disk"]["queue_depth"] == 0:
            break
        time.sleep(0.05)
    d.kill9()
    d.start()
    (b,) = run_worker(d.socket, "load:9:64")
    assert b["loaded"] == 16 and b["bad_pages"] == 0


def test_the_configured_disk_queue_bound_reaches_the_tier(daemon_factory):
    from hicache.client.connection import RpcConnection

    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_DISK_QUEUE_PAGES": "7"}).start()
    conn = RpcConnection.connect(d.socket, timeout_s=30)
    conn.hello()
    assert conn.call("doctor")["disk"]["max_queue_pages"] == 7
    conn.close()


def test_a_child_is_written_even_when_its_parent_lost_only_its_disk_copy(daemon_factory):
    """The tier commits a page only under a committed parent: a parent whose disk copy was
    evicted while its host copy stayed is written again first, not its child refused."""
    from hicache.client.connection import RpcConnection
    from tests.daemon.test_isolation import LAYOUT, engine, store, tokens
    from tests.wait import wait_until

    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB").start()
    admin = RpcConnection.connect(d.socket, timeout_s=30)
    admin.hello()

    def disk() -> dict:
        return admin.call("stats")["tiers"]["disk"]

    a = engine(d.socket, "t")
    toks = tokens(5, 8)
    store(a, toks[:4 * LAYOUT.page_size])
    wait_until(lambda: disk()["pages"] == 4, what="the prefix on disk")
    assert admin.call("evict_tier", {"tier": "disk", "bytes": 4 * LAYOUT.page_bytes})["bytes"] > 0
    wait_until(lambda: disk()["pages"] == 0, what="the prefix's disk copy gone")
    store(a, toks)  # the prefix is on host only; its continuation is written through
    st = wait_until(lambda: (s := disk())["pages"] == 8 and not s["queue_depth"] and s, what="all 8 pages on disk")
    assert st["rejected_orphan"] == 0
    a.close()
    admin.close()
