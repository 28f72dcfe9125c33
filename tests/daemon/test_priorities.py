"""Prefix priorities against real daemons: a high-priority prefix outlives a flood that takes
its unprioritized twin (host, and disk), a tenant over its quota still gives prioritized
pages up, bounds and refusals, expiry, `stats` / `ls` and the admin CLI."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.bench.policy.pin_bench import LAYOUT, _pattern, _store, _tokens
from hicache.cli.main import main as cli
from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.hints import RetainHint
from hicache.errors import ClientError
from tests.wait import wait_until

PB = LAYOUT.page_bytes
LRU = {"HICACHE_EVICTION_POLICY": "lru", "HICACHE_LOAD_POLICY": "wait_complete"}


def client(d, model: str = "prio") -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model=model, socket_path=d.socket, timeout_s=30.0)
    assert c.connect()
    return c


def stats(sock: str) -> dict:
    return RpcConnection.one_call(sock, "stats", None, timeout_s=10.0)


def namespace(sock: str) -> dict:
    (ns,) = RpcConnection.one_call(sock, "ls", {"depth": 0}, timeout_s=10.0)["namespaces"]
    return ns


def kept_pages(c: HiCacheClient, toks: np.ndarray) -> int:
    """Pages of the prefix hicache hands back, each checked byte for byte."""
    m = c.match(toks)
    for key, slot in zip(m.keys, m.host_pages):
        assert np.array_equal(c.arena.array[int(slot) * PB:(int(slot) + 1) * PB], _pattern(key))
    c.release(m)
    return m.host_len


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_high_priority_prefix_outlives_a_flood_that_takes_its_twin(daemon_factory, tier):
    if tier == "host":  # 256 host pages; the flood is 320
        d = daemon_factory("--host-capacity", "16MiB", "--no-disk", env=LRU).start()
    else:  # 32 host pages, 256 on disk; the flood is 480, written to disk as the host evicts it
        d = daemon_factory("--host-capacity", "2MiB", "--disk-capacity", "16MiB",
                           env={**LRU, "HICACHE_DISK_ADMISSION": "all"}).start()
    c = client(d)
    hinted, twin = _tokens(1, 1, 4), _tokens(1, 2, 4)  # stored together: LRU would keep neither
    _store(c, hinted), _store(c, twin)
    if tier == "disk":
        assert RpcConnection.one_call(d.socket, "settle", {"timeout_s": 30})["settled"]
        RpcConnection.one_call(d.socket, "evict_tier", {"tier": "host", "bytes": 1 << 40})
        assert namespace(d.socket)["pages"] == {"device": 0, "host": 0, "disk": 8}  # both only on disk now
    r = c.retain(RetainHint(priority=5), hinted)
    assert r is not None and r["pages"] == 4 and r["priority"] == 5
    flood = 40 if tier == "host" else 60
    for i in range(flood):
        _store(c, _tokens(2, i, 8))
        if tier == "disk" and i % 10 == 9:
            RpcConnection.one_call(d.socket, "settle", {"timeout_s": 30})
    st = stats(d.socket)
    if tier == "host":  # the flood went through the tier
        assert st["tiers"]["host"]["evicted_pages"] >= 8 * flood - 256
    else:  # 480+ pages admitted into 256: the disk's budget evicted the rest, and says so
        assert st["tiers"]["disk"]["admission"]["admitted_pages"] > 256
        assert st["tiers"]["disk"]["evicted_pages"] >= st["tiers"]["disk"]["admission"]["admitted_pages"] - 256
    assert kept_pages(c, hinted) == 4  # every page, from the tier
    assert kept_pages(c, twin) == 0  # the same prefix without the priority is flooded out
    assert st["priorities"]["prefixes"] == 1 and st["priorities"]["positive_pages"] == 4
    c.close()


def test_a_tenant_over_its_max_still_gives_up_prioritized_pages_lowest_first(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk", "--quota", "model=prio,tier=host,max=512KiB",
                       env=LRU).start()  # 8 pages
    c = client(d)
    p, q, r, s = (_tokens(1, i, 4) for i in range(4))
    _store(c, p), _store(c, q)
    assert c.retain(RetainHint(priority=9), p)["pages"] == 4
    assert c.retain(RetainHint(priority=3), q)["pages"] == 4
    _store(c, r)  # at its max: its own lowest-priority pages go, prioritized or not
    assert namespace(d.socket)["pages"]["host"] == 8
    assert kept_pages(c, p) == 4 and kept_pages(c, q) == 0 and kept_pages(c, r) == 4
    _store(c, s)  # r has no priority: it goes before p does
    assert kept_pages(c, p) == 4 and kept_pages(c, r) == 0 and kept_pages(c, s) == 4
    assert stats(d.socket)["quotas"]["throttled_pages"]["host"] >= 8
    c.close()


def test_refused_priorities_change_nothing_and_priorities_expire(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk",
                       env={"HICACHE_PRIORITY_MAX_SHARE": "0.05", "HICACHE_PRIORITY_TTL_S": "0.5"}).start()
    c = client(d)
    big, small = _tokens(1, 1, 16), _tokens(1, 2, 4)  # 16 pages is over 5% of 256, 4 is within
    _store(c, big), _store(c, small)
    conn = RpcConnection.connect(d.socket)
    conn.hello()
    engine = conn.call("register", {"model": "prio", "layout": LAYOUT.to_dict(), "device_pages": 64})["engine"]
    keys = b"".join(c.page_keys(big))
    for params, code in [({"priority": 1001}, "BAD_PARAMS"), ({"priority": "high"}, "BAD_PARAMS"),
                         ({}, "BAD_PARAMS"), ({"priority": 1, "ttl_s": 1e9}, "BAD_PARAMS"),
                         ({"priority": 1, "ttl_s": -1}, "BAD_PARAMS"), ({"priority": 1, "tier": "host"}, "BAD_PARAMS"),
                         ({"priority": 1, "keys": b"".join(c.page_keys(_tokens(9, 9, 2)))}, "NOT_FOUND"),
                         ({"priority": 1}, "BAD_PARAMS")]:  # over the bound
        with pytest.raises(ClientError) as e:
            conn.call("prioritize", {"engine": engine, "keys": keys, **params})
        assert e.value.code == code, params
    st = stats(d.socket)["priorities"]
    assert st["prefixes"] == 0 and st["pages"] == 0 and st["refused"] == 1
    assert conn.call("prioritize", {"engine": engine, "keys": keys, "priority": -4})["pages"] == 16  # unbounded
    r = conn.call("prioritize", {"engine": engine, "tokens": small.tobytes(), "priority": 2, "ttl_s": 600})
    assert r["pages"] == 4
    wait_until(lambda: stats(d.socket)["priorities"]["expired"] == 1, what="the default-TTL priority's expiry")
    assert [(e["priority"], e["pages"]) for e in namespace(d.socket)["priorities"]] == [(2, 4)]
    r = conn.call("prioritize", {"engine": engine, "tokens": small.tobytes(), "priority": 0})  # drops it
    assert r["pages"] == 0 and namespace(d.socket)["priorities"] == []
    conn.close(), c.close()


def test_an_admin_prioritizes_from_the_cli_and_sees_it_in_ls_and_stats(daemon, capsys):
    c = client(daemon)
    toks = _tokens(1, 1, 3)
    _store(c, toks)
    ns = c.salt.hex()[:12]
    tokens = ",".join(str(t) for t in toks)
    assert cli(["prioritize", "--socket", daemon.socket, "--namespace", ns, "--tokens", tokens,
                "--priority", "7", "--ttl", "1h"]) == 0
    assert "priority 7 on 3 pages" in capsys.readouterr().out
    assert cli(["ls", "--socket", daemon.socket, "--depth", "0"]) == 0
    assert "  priority 7  " in capsys.readouterr().out
    out = RpcConnection.one_call(daemon.socket, "ls", {"depth": 0})["namespaces"][0]["priorities"]
    assert [(e["priority"], e["pages"]) for e in out] == [(7, 3)]
    assert cli(["stats", "--socket", daemon.socket]) == 0
    assert "prioritized 1 prefixes (3 pages, 3 above 0)" in capsys.readouterr().out
    assert cli(["prioritize", "--socket", daemon.socket, "--namespace", "prio", "--tokens", tokens,
                "--priority", "0"]) == 0
    assert "priority dropped" in capsys.readouterr().out
    assert cli(["prioritize", "--socket", daemon.socket, "--namespace", ns, "--tokens", tokens,
                "--priority", "5000"]) == 1
    assert "priority must be" in capsys.readouterr().err
    c.close()
