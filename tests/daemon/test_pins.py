"""Pinned prefixes against real daemons: the hint goal (5% pinned keep every hit under a
flood), bounds and refusals, expiry, a restart, the admin CLI and SGLang's keyed pages."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.bench.policy.pin_bench import LAYOUT, PinWorkload, _pattern, _store, _tokens, measure
from hicache.cli.main import main as cli
from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.hints import RetainHint
from hicache.client.keyed import KeyedPagesClient, named_page
from hicache.errors import ClientError
from tests.wait import wait_until

PB = LAYOUT.page_bytes


def client(d) -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model="pins", socket_path=d.socket, timeout_s=30.0)
    assert c.connect()
    return c


def pinned(sock: str) -> dict:
    return RpcConnection.one_call(sock, "stats", None, timeout_s=10.0)["pinned"]


def pins_listed(sock: str) -> list[dict]:
    (ns,) = RpcConnection.one_call(sock, "ls", {"depth": 0}, timeout_s=10.0)["namespaces"]
    return ns["pins"]


def test_five_percent_pinned_keep_every_hit_under_a_flood_and_lose_them_without(tmp_path):
    w = PinWorkload(prefixes=20, rounds=2)  # 1 of 20 pinned; 40 one-shot prompts of 8 pages a round
    with_pins, without = measure(w, str(tmp_path))
    assert with_pins.pinned_hit_rate == 1.0 and with_pins.bad_pages == 0
    assert without.pinned_hit_rate < 0.5  # the same prefix, unpinned, is flooded out
    assert with_pins.pinned_stats["host"] == {"pins": 1, "pages": w.prefix_pages, "suspended": 0}


def test_refused_pins_change_nothing(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk", env={"HICACHE_PIN_MAX_SHARE": "0.05"}).start()
    c = client(d)
    big, small = _tokens(1, 1, 16), _tokens(1, 2, 4)  # 16 pages is over 5% of 256, 4 is within
    _store(c, big), _store(c, small)
    conn = RpcConnection.connect(d.socket)
    conn.hello()
    engine = conn.call("register", {"model": "pins", "layout": LAYOUT.to_dict(), "device_pages": 64})["engine"]
    keys = b"".join(c.page_keys(big))
    before = pinned(d.socket)
    for params, code in [({"ttl_s": 0}, "BAD_PARAMS"), ({"ttl_s": 1e9}, "BAD_PARAMS"),
                         ({"ttl_s": 60, "tier": "device"}, "BAD_PARAMS"),
                         ({"ttl_s": 60, "tier": "disk"}, "BAD_PARAMS"),  # no disk tier
                         ({"ttl_s": 60, "priority": 5000}, "BAD_PARAMS"),
                         ({"ttl_s": 60, "keys": b"".join(c.page_keys(_tokens(9, 9, 2)))}, "NOT_FOUND"),
                         ({"ttl_s": 60, "tokens": big.tobytes()}, "BAD_PARAMS"),  # both keys and tokens
                         ({"ttl_s": 60}, "BAD_PARAMS")]:  # over the bound
        with pytest.raises(ClientError) as e:
            conn.call("pin", {"engine": engine, "keys": keys, **params})
        assert e.value.code == code, params
    after = pinned(d.socket)
    assert after["host"] == before["host"] == {"pins": 0, "pages": 0, "suspended": 0} and after["refused"] == 1
    r = conn.call("pin", {"engine": engine, "tokens": small.tobytes(), "ttl_s": 60})  # by tokens
    assert r["pages"] == 4 and pinned(d.socket)["host"]["pages"] == 4
    assert conn.call("unpin", {"engine": engine, "keys": b"".join(c.page_keys(small))}) == {"removed": 1}
    conn.close(), c.close()


def test_a_pin_expires_on_its_own(daemon):
    c = client(daemon)
    toks = _tokens(1, 1, 4)
    _store(c, toks)
    assert c.pin(RetainHint(0.5), toks)["pages"] == 4
    wait_until(lambda: pinned(daemon.socket)["expired"] == 1, what="the pin's expiry")
    assert pinned(daemon.socket)["host"]["pins"] == 0 and pins_listed(daemon.socket) == []
    c.close()


def test_pins_survive_a_restart_and_keep_their_pages(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    c = client(d)
    kept_on_disk, kept_on_host, brief = _tokens(1, 1, 4), _tokens(1, 2, 3), _tokens(1, 3, 2)
    for toks in (kept_on_disk, kept_on_host, brief):
        _store(c, toks)
    assert RpcConnection.one_call(d.socket, "settle", {"timeout_s": 30})["settled"]
    assert c.pin(RetainHint(600, "disk", priority=2), kept_on_disk)["pages"] == 4
    assert c.pin(RetainHint(600, "host"), kept_on_host)["pages"] == 3
    assert c.pin(RetainHint(0.2, "host"), brief)["pages"] == 2
    c.close()
    wait_until(lambda: pinned(d.socket)["expired"] == 1, what="the brief pin's expiry")
    d.stop()
    d.start()
    assert pinned(d.socket)["restored"] == 2
    assert sorted((p["tier"], p["pages"], p["priority"]) for p in pins_listed(d.socket)) == [("disk", 4, 2),
                                                                                         ("host", 3, 0)]
    RpcConnection.one_call(d.socket, "evict_tier", {"tier": "disk", "bytes": 1 << 40})
    (ns,) = RpcConnection.one_call(d.socket, "ls", {"depth": 0})["namespaces"]
    assert ns["pages"]["disk"] == 7  # both pins' pages stay; the unpinned prefix went
    c = client(d)
    for toks in (kept_on_disk, kept_on_host):  # read back from disk, byte-exact
        m = c.match(toks)
        n = len(toks) // LAYOUT.page_size
        assert m.host_len == n, m
        assert [c.arena.array[int(s) * PB:(int(s) + 1) * PB].tobytes() for s in m.host_pages] == \
            [_pattern(k).tobytes() for k in m.keys]
        c.release(m)
    assert c.match(brief).host_len == 0
    c.close()


def test_admin_pins_and_unpins_from_the_cli(daemon, capsys):
    c = client(daemon)
    toks = _tokens(1, 1, 3)
    _store(c, toks)
    ns = c.salt.hex()[:12]
    tokens = ",".join(str(t) for t in toks)
    assert cli(["pin", "--socket", daemon.socket, "--namespace", ns, "--tokens", tokens, "--ttl", "5m",
                "--priority", "7"]) == 0
    assert "pinned 3 pages in host" in capsys.readouterr().out
    assert cli(["ls", "--socket", daemon.socket, "--depth", "0"]) == 0
    out = capsys.readouterr().out
    assert "pin " in out and "host  3 pages" in out and "priority 7" in out
    assert cli(["stats", "--socket", daemon.socket]) == 0
    assert "pinned host 1 (3 pages" in capsys.readouterr().out
    key = pins_listed(daemon.socket)[0]["key"]
    assert cli(["unpin", "--socket", daemon.socket, "--namespace", "pins", "--key", key]) == 0
    assert "removed 1 pins" in capsys.readouterr().out
    assert cli(["pin", "--socket", daemon.socket, "--namespace", ns, "--tokens", "1,2", "--ttl", "1h"]) == 1
    assert "no full page" in capsys.readouterr().err
    c.close()


def test_sglang_keyed_chain_is_pinned_by_its_last_page_name(daemon):
    kc = KeyedPagesClient(client(daemon))
    chain = [named_page(kc.client.salt, f"h{i}".encode(), LAYOUT.page_size) for i in range(3)]
    other = [named_page(kc.client.salt, f"x{i}".encode(), LAYOUT.page_size) for i in range(2)]
    parent = None
    for pages in (chain, other):
        parent = None
        for key, toks in pages:
            res = kc.store([key], toks, parent)
            kc.client.arena.array[int(res.host_pages[0]) * PB:(int(res.host_pages[0]) + 1) * PB] = _pattern(key)
            assert kc.store_done(res) == 1
            parent = key
    r = kc.pin([chain[-1][0]], RetainHint(600))  # SGLang names a chain by its pages' hashes
    assert r is not None and r["pages"] == 3
    RpcConnection.one_call(daemon.socket, "evict_tier", {"tier": "host", "bytes": 1 << 40})
    assert kc.exists([k for k, _ in chain]) == 3 and kc.exists([other[0][0]]) == 0
    kc.client.close()
