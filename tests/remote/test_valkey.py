"""The Redis backend on a real Valkey server, standalone and as a 3-master cluster:
the remote tier's records go through unchanged (pages shared bit-exact between two
daemons) and a damaged record is refused, as on Redis."""

from __future__ import annotations

import pytest

redis = pytest.importorskip("redis")  # the test extra; missing only on a machine set up without it

from hicache.tiers.remote.redis_store import record_key
from hicache.tiers.remote.store import address
from tests.daemon.test_isolation import engine, store, tokens
from tests.remote.util import DAEMON_FLAGS, load_remote, remote_env, remote_stats, wait_remote_up, wait_written

PAGES = 24  # a run and a half: two hash slots on a cluster


def test_pages_shared_through_valkey_load_bit_exact_and_damage_is_refused(valkey, daemon_factory):
    a = daemon_factory(*DAEMON_FLAGS, env=remote_env(valkey.url)).start()
    b = daemon_factory(*DAEMON_FLAGS, env=remote_env(valkey.url)).start()
    mode = "cluster" if valkey.masters else "standalone"
    for d in (a, b):
        assert wait_remote_up(d.socket)["mode"] == mode
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    shared, damaged = tokens(1, PAGES), tokens(2, 8)
    store(ea, shared)
    store(ea, damaged)
    wait_written(a.socket, PAGES + 8)
    assert load_remote(eb, shared) == PAGES

    r = (redis.RedisCluster.from_url(valkey.url) if valkey.masters else redis.Redis.from_url(valkey.url))
    with redis.Redis(port=valkey.nodes[0].port) as node:
        assert node.info("server").get("server_name") == "valkey"  # Valkey itself, not redis-server
    victim = record_key(address(ea.client.salt, ea.client.page_keys(damaged), 4))
    assert r.setrange(victim, 2000, b"\xff\x00\xff")
    assert load_remote(eb, damaged) == 4
    st = remote_stats(b.socket)
    assert st["corrupt_reasons"] == {"checksum": 1} and st["hit_pages"] == PAGES + 4, st
    r.close()
    ea.close()
    eb.close()
