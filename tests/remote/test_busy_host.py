"""A store that answers slowly is not a store that is down. On a host busy with CPU hogs,
behind a forwarder that delays every packet (a round trip of 60 ms or more, where a
5 ms lookup deadline once turned every probe into a miss), every probe's answer still
counts, the breaker stays closed and every write arrives; writes made while the store is
briefly away are held and arrive when it is back."""

from __future__ import annotations

from tests.daemon.test_isolation import engine, store, tokens
from tests.remote.load import DelayProxy, cpu_hogs
from tests.remote.test_faults import PAGES
from tests.remote.util import DAEMON_FLAGS, load_remote, remote_env, remote_stats, wait_remote_up, wait_written
from tests.wait import wait_until

PROMPTS = 6
DELAY_S = 0.03  # each way: a round trip of 60 ms or more


def test_every_write_reaches_a_slow_store_on_a_busy_host(redis_standalone, daemon_factory):
    port = redis_standalone.nodes[0].port
    with DelayProxy(("127.0.0.1", port), DELAY_S) as proxy, cpu_hogs(2):
        a = daemon_factory(*DAEMON_FLAGS, env=remote_env(proxy.url)).start()
        b = daemon_factory(*DAEMON_FLAGS, env=remote_env(proxy.url)).start()
        wait_remote_up(a.socket, 60)
        wait_remote_up(b.socket, 60)
        ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
        prompts = [tokens(300 + i, PAGES) for i in range(PROMPTS)]
        for toks in prompts:
            store(ea, toks)  # each lookup first: its match answers at once, its probe runs on
        wait_written(a.socket, PROMPTS * PAGES, 120)
        st = wait_until(lambda: (s := remote_stats(a.socket))["probes_in_flight"] == 0 and s, 60,
                        "A's probes to be answered")
        # every probe of A's lookups was answered, however late: the store was slow...
        assert st["probes"] >= PROMPTS and st["probes_failed"] == 0, st
        assert st["breaker_opens"] == 0 and st["state"] == "up", st  # ...not down
        assert st["written_pages"] == PROMPTS * PAGES, st
        assert st["dropped_pages"] == 0 and st["failed_writes"] == 0, st
        for toks in prompts:  # and what arrived is what was stored, byte for byte
            assert load_remote(eb, toks) == PAGES
        assert remote_stats(b.socket)["corrupt_records"] == 0
        assert proxy.relayed_chunks > 0
        ea.close()
        eb.close()


def test_writes_made_while_the_store_is_away_arrive_when_it_is_back(redis_standalone, daemon_factory):
    node = redis_standalone.nodes[0]
    a = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_standalone.url, HICACHE_REMOTE_WRITE_HOLD_S="60")).start()
    b = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_standalone.url)).start()
    wait_remote_up(a.socket)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    node.kill()
    away = tokens(401, PAGES)
    store(ea, away)  # its lookup finds the store refusing; the breaker opens; the write waits
    wait_until(lambda: remote_stats(a.socket)["state"] == "down", 30, "A to see the store down")
    st = remote_stats(a.socket)
    assert st["written_pages"] == 0 and st["queue_pages"] == PAGES and st["dropped_pages"] == 0, st
    node.start(redis_standalone.binary)  # back, empty
    st = wait_written(a.socket, PAGES, 60)
    assert st["dropped_pages"] == 0 and st["failed_writes"] == 0 and st["breaker_opens"] >= 1, st
    wait_remote_up(b.socket)
    assert load_remote(eb, away) == PAGES
    ea.close()
    eb.close()
