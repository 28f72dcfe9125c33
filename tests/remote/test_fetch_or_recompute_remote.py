"""Fetch or recompute on the remote tier (hicache/daemon/core/fetch_or_recompute.py): daemon B
fetches from the real Redis Cluster a prompt daemon A computed only when its engine computes
slower than the store delivers; the store's fetches are what B measures."""

from __future__ import annotations

import numpy as np

from tests.daemon.test_fetch_or_recompute import FAST, PB, SLOW, engine, fetch_stats, prompt, store
from tests.remote.util import ask, remote_stats, two_daemons, wait_written


def lookup(c, toks, seed: int) -> tuple[int, int]:
    """(host_len, disk_len) of a match asked until its lookup ended, every host page checked
    byte-exact, released."""
    r = ask(c, c.page_keys(toks))
    host_pages = np.frombuffer(r["host_pages"], dtype="<i4")
    c.sync_slabs()
    for i, slot in enumerate(host_pages):
        assert (c.arena.array[slot * PB:(slot + 1) * PB] == (seed * 31 + i) % 251).all(), f"page {i}"
    c.conn.call("release", {"pin": r["pin"]})
    return len(host_pages), r["disk_len"]


def test_a_remote_part_the_engine_computes_faster_is_not_fetched(redis_cluster, daemon_factory):
    a, b = two_daemons(daemon_factory, redis_cluster.url, HICACHE_FETCH_REMEASURE_S="3600")
    on_a, fast, slow = engine(a.socket), engine(b.socket, FAST), engine(b.socket, SLOW)
    first, second = prompt(21), prompt(22)
    store(on_a, first, 21)
    store(on_a, second, 22)
    wait_written(a.socket, 16)
    # B never read the store: nothing to weigh a fetch with, the fast engine fetches as any other
    assert lookup(fast, first, 21) == (8, 0)
    assert remote_stats(b.socket)["hit_pages"] == 8
    assert fetch_stats(b.socket)["tiers"]["remote"]["samples"] == 1
    # measured now: the fast engine recomputes the second prompt rather than fetch it
    assert lookup(fast, second, 22) == (0, 0)
    fr = fetch_stats(b.socket)
    assert fr["skipped_pages"] == {"disk": 0, "remote": 8} and fr["skipped_tokens"]["remote"] == 8 * 16
    assert remote_stats(b.socket)["hit_pages"] == 8  # nothing fetched
    # the slow engine fetches it, verified and bit-exact
    assert lookup(slow, second, 22) == (8, 0)
    assert remote_stats(b.socket)["hit_pages"] == 16 and remote_stats(b.socket)["corrupt_records"] == 0
    for c in (on_a, fast, slow):
        c.close()
