"""Remote admission (hicache/daemon/movers/remote_admission.py) on a real Redis Cluster: while
the store has room every page is written; once its masters are near their `maxmemory`, a
one-shot prompt stays local and a prompt looked up twice is still shared."""

from __future__ import annotations

from tests.daemon.test_fetch_or_recompute import engine, lookup, prompt, store
from tests.remote.util import DAEMON_FLAGS, remote_env, remote_stats, wait_remote_up, wait_written
from tests.wait import wait_until


def set_maxmemory(cluster, full: bool) -> None:
    """full: some 12 MiB of other records, then every master's maxmemory just above what it
    uses (over 90% of it: no room; the fixture's allkeys-lru evicts those records to take
    new writes); else the fixture's 512 MiB back."""
    if full:
        from redis.cluster import RedisCluster

        other = RedisCluster.from_url(cluster.url)
        try:
            for i in range(384):
                other.set(f"other-tenant:{i}", b"x" * (32 << 10))
        finally:
            other.close()
    for node in cluster.masters_now():
        used = int(node.info("memory")["used_memory"])
        node.cmd("CONFIG", "SET", "maxmemory", str(int(used / 0.95)) if full else "512mb")


def admission(socket: str) -> dict:
    return remote_stats(socket)["admission"]


def test_a_full_store_takes_only_pages_expected_back(redis_cluster, daemon_factory):
    d = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_cluster.url)).start()
    wait_remote_up(d.socket)
    c = engine(d.socket)
    try:
        # room: a one-shot prompt is written, as before admission
        store(c, prompt(1), 1)
        wait_written(d.socket, 8)
        assert admission(d.socket) == {"mode": "reuse", "room": True, "admitted_pages": 8, "rejected_pages": 0}
        set_maxmemory(redis_cluster, full=True)
        wait_until(lambda: not admission(d.socket)["room"], what="the daemon to see the store full")
        # full: another one-shot prompt stays local (host and disk), nothing is sent
        store(c, prompt(2), 2)
        assert admission(d.socket)["rejected_pages"] == 8
        # a prompt looked up twice before it is computed is expected back: shared
        reused = prompt(3)
        for _ in range(2):
            assert lookup(c, reused, 3) == (0, 0, 0)
        store(c, reused, 3)
        st = wait_written(d.socket, 16)
        assert st["written_pages"] == 16 and st["admission"]["admitted_pages"] == 16
        assert st["admission"]["rejected_pages"] == 8
        # room again: every page goes
        set_maxmemory(redis_cluster, full=False)
        wait_until(lambda: admission(d.socket)["room"], what="the daemon to see room in the store")
        store(c, prompt(4), 4)
        assert wait_written(d.socket, 24)["admission"]["rejected_pages"] == 8
    finally:
        set_maxmemory(redis_cluster, full=False)
        c.close()
