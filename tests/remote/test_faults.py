"""The remote tier when the store misbehaves (a real redis-server): corrupted records
are refused and counted, never served; a stopped, killed or restarted store never
delays a match (its probes fail at the op timeout, then the breaker spares the store),
the daemon never crashes, and the tier comes back when the store does."""

from __future__ import annotations

import time

import pytest

from hicache.tiers.remote.record import HEADER_BYTES
from hicache.tiers.remote.redis_store import record_key
from hicache.tiers.remote.store import address
from tests.daemon.test_isolation import LAYOUT, engine, store, tokens
from tests.remote.util import (DAEMON_FLAGS, ask, load_remote, remote_env, remote_stats,
                               two_daemons, wait_remote_up, wait_written)
from tests.wait import wait_until

PAGES = 8
PAGE_AT = HEADER_BYTES + 4 * LAYOUT.page_size  # where the page bytes start in a record


def _redis(server):
    import redis

    return redis.Redis.from_url(server.url)


CORRUPTIONS = {
    # name: (how the record of page 5 is damaged, the reason counted)
    "page_bytes": (lambda r, k: r.setrange(k, PAGE_AT + 1000, b"\xff\x00\xff"), "checksum"),
    "tokens": (lambda r, k: r.setrange(k, HEADER_BYTES + 8, b"\x01"), "checksum"),
    "namespace": (lambda r, k: r.setrange(k, 8, b"\x00" * 4), "namespace"),
    "truncated": (lambda r, k: r.set(k, r.get(k)[:-100]), "truncated"),
    "not_a_record": (lambda r, k: r.set(k, b"hello"), "truncated"),
    "another_page": (None, "key"),  # page 6's record stored under page 5's key
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_a_corrupted_record_is_a_counted_miss_never_served(damage, redis_standalone, daemon_factory):
    a, b = two_daemons(daemon_factory, redis_standalone.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    toks = tokens(11, PAGES)
    store(ea, toks)
    wait_written(a.socket, PAGES)
    keys = ea.client.page_keys(toks)
    victim = record_key(address(ea.client.salt, keys, 5))
    r = _redis(redis_standalone)
    assert r.exists(victim)
    how, reason = CORRUPTIONS[damage]
    if how is None:
        r.set(victim, r.get(record_key(address(ea.client.salt, keys, 6))))
    else:
        how(r, victim)
    # B gets the 5 pages before the damaged one, each byte checked, and nothing after it
    assert load_remote(eb, toks) == 5
    st = remote_stats(b.socket)
    assert st["corrupt_records"] == 1 and st["corrupt_reasons"] == {reason: 1}, st
    assert st["hit_pages"] == 5
    ea.close()
    eb.close()
    assert b.running


def _misses(cache, seeds) -> list[float]:
    """Lookup latency (match + release) of prompts no tier holds (a match answers the local
    tiers at once; the remote store is asked in the background)."""
    out = []
    for seed in seeds:
        t0 = time.perf_counter()
        m = cache.client.match(tokens(seed, PAGES))
        out.append(time.perf_counter() - t0)
        assert m.host_len == 0 and m.disk_len == 0
        cache.client.release(m)
    return out


def test_a_stopped_store_opens_the_breaker_and_then_costs_a_lookup_nothing(redis_standalone, daemon_factory):
    a, b = two_daemons(daemon_factory, redis_standalone.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    before = tokens(21, PAGES)
    store(ea, before)
    wait_written(a.socket, PAGES)
    _misses(eb, range(100, 110))  # store up: each match's probe is answered in the background
    probes = wait_until(lambda: (s := remote_stats(b.socket))["probes_in_flight"] == 0 and s, 30,
                        "B's probes to be answered")["probes"]

    redis_standalone.nodes[0].pause()  # SIGSTOP: connections hang, nothing is refused
    try:
        _misses(eb, range(200, 220))  # answered from the local tiers: no match waits for the store
        # the probes those matches sent run out the op timeout (1 s) and fail; with the worker's own
        # PINGs of the suspect store they open the breaker, no further traffic needed
        st = wait_until(lambda: (s := remote_stats(b.socket))["state"] == "down" and s["probes_in_flight"] == 0
                        and s, 30, "B to see it down")
        assert not st["available"] and st["breaker_opens"] == 1, st
        sent = st["probes"] - probes
        assert 1 <= sent <= 20 and st["probes_failed"] == sent and st["hit_pages"] == 0, st
        store(ea, tokens(22, PAGES))  # writes while down: held, then dropped or failed, never waited for
        # the breaker open, a lookup skips the store at no cost: no probe, nothing pending
        m = ask(eb.client, eb.client.page_keys(tokens(230, PAGES)), until="now")
        assert "pending" not in m and m["disk_len"] == 0, m
        eb.client.conn.call("release", {"pin": m["pin"]})
        assert remote_stats(b.socket)["probes"] == st["probes"]
        assert a.running and b.running
    finally:
        redis_standalone.nodes[0].resume()
    wait_remote_up(b.socket)
    wait_remote_up(a.socket)
    assert load_remote(eb, before) == PAGES  # hits again
    st = remote_stats(b.socket)
    assert st["hit_pages"] == PAGES and st["breaker_opens"] >= 1
    ea.close()
    eb.close()


def test_a_killed_store_is_a_miss_and_its_restart_is_picked_up(redis_standalone, daemon_factory):
    a, b = two_daemons(daemon_factory, redis_standalone.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    old = tokens(31, PAGES)
    store(ea, old)
    wait_written(a.socket, PAGES)
    node = redis_standalone.nodes[0]
    node.kill()
    assert _misses(eb, [32, 33, 34]) and b.running
    wait_until(lambda: remote_stats(b.socket)["state"] == "down", 10, "B to see the store down")
    node.start(redis_standalone.binary)  # same port, empty: a restarted node forgets everything
    wait_remote_up(a.socket)
    wait_remote_up(b.socket)
    assert load_remote(eb, old) == 0  # gone with the restart: a plain miss
    new = tokens(35, PAGES)
    store(ea, new)
    wait_until(lambda: remote_stats(a.socket)["written_pages"] >= 2 * PAGES, 30, "A to write again")
    assert load_remote(eb, new) == PAGES
    assert remote_stats(b.socket)["corrupt_records"] == 0
    ea.close()
    eb.close()


def test_admin_flush_deletes_a_namespace_records(redis_standalone, daemon_factory):
    import subprocess
    import sys

    a, b = two_daemons(daemon_factory, redis_standalone.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    toks = tokens(41, PAGES)
    store(ea, toks)
    wait_written(a.socket, PAGES)
    salt = ea.client.salt.hex()
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "flush", "--tier", "remote", "--namespace", salt,
                          "--socket", b.socket], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"deleted {PAGES} remote records" in out.stdout
    assert load_remote(eb, toks) == 0
    assert not _redis(redis_standalone).keys(b"hc1:" + salt.encode() + b":*")
    ea.close()
    eb.close()


def test_metrics_show_the_remote_tier(redis_standalone, daemon_factory):
    from tests.daemon.disk_faults_util import free_port, metrics_text

    port = free_port()
    a = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_standalone.url)).start()
    b = daemon_factory(*DAEMON_FLAGS, "--metrics-port", str(port), env=remote_env(redis_standalone.url)).start()
    wait_remote_up(a.socket)
    wait_remote_up(b.socket)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    toks = tokens(61, PAGES)
    store(ea, toks)
    wait_written(a.socket, PAGES)
    assert load_remote(eb, toks) == PAGES

    def scraped() -> str | None:
        text = metrics_text(port)
        return text if f'hicache_hits_total{{tier="remote"}} {float(PAGES)}' in text else None

    text = wait_until(scraped, 30, "the remote hits in /metrics")
    assert "hicache_remote_up 1.0" in text
    assert 'hicache_remote_backend{backend="redis"} 1.0' in text
    assert 'hicache_remote_latency_seconds_count{op="fetch"}' in text
    assert 'hicache_bytes_moved_total{dst="host",src="remote"}' in text
    ea.close()
    eb.close()


def test_a_missing_continuation_is_probed_once_then_remembered(redis_standalone, daemon_factory):
    d = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_standalone.url, HICACHE_REMOTE_NEGATIVE_TTL_S="60")).start()
    wait_remote_up(d.socket)
    e = engine(d.socket, "t")
    keys = e.client.page_keys(tokens(71, PAGES))
    for _ in range(3):  # each asked until its lookup ended
        m = ask(e.client, keys)
        assert len(m["host_pages"]) == 0 and m["disk_len"] == 0, m
        e.client.conn.call("release", {"pin": m["pin"]})
    st = remote_stats(d.socket)
    assert st["probes"] == 1 and st["negative_hits"] == 2 and st["miss_pages"] == PAGES, st
    store(e, tokens(72, PAGES))  # our own writes clear their keys from the negative cache
    e.close()


def test_a_daemon_started_before_its_store_joins_it_later(tmp_path, daemon_factory):
    from tests.remote.conftest import _require_redis

    _require_redis()
    from hicache.bench.procs.redis_procs import RedisNode, free_port, redis_server_binary

    node = RedisNode(free_port(), tmp_path / "late")
    d = daemon_factory(*DAEMON_FLAGS, env=remote_env(f"redis://127.0.0.1:{node.port}")).start()
    try:
        e = engine(d.socket, "t")
        assert _misses(e, [81])  # served while the store is away
        st = wait_until(lambda: (s := remote_stats(d.socket))["last_error"] and s, 30, "a failed first connection")
        # refused, or on a crawling host the connect's own deadline: either way shown
        assert st["state"] == "connecting" and not st["available"], st
        assert "Error" in st["last_error"] or st["last_error"] == "timed out", st
        node.start(redis_server_binary())
        assert wait_remote_up(d.socket)["mode"] == "standalone"
        e.close()
    finally:
        node.kill()
