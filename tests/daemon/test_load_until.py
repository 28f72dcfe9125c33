"""`load {pin, until}` on a match's disk part, against a real daemon with the default
load policy (best_effort): the disk part is never lost to a fixed deadline. A client
that asks again (`until: "now"`) gets it all, one that waits (`until: "complete"`) gets
it in one answer, every page byte-exact; a bad `until` is refused and changes nothing.
(The remote part: tests/remote/test_remote_lookups.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from hicache.errors import ClientError
from tests.daemon.test_fetch_or_recompute import PB, admin, engine, prompt, store, to_disk_only
from tests.wait import wait_until

PAGES = 8
SEED = 31
FLAGS = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")


def _on_disk(daemon_factory):
    """A daemon whose one prompt is on disk only, and a client of its namespace."""
    d = daemon_factory(*FLAGS).start()
    c = engine(d.socket)
    toks = prompt(SEED, PAGES)
    store(c, toks, SEED)
    to_disk_only(d.socket)
    return d, c, c.page_keys(toks)


def _match(c, keys: list[bytes]) -> dict:
    m = c.conn.call("match", {"engine": c.engine_id, "keys": b"".join(keys)}, timeout_s=30.0)
    # no remote tier: nothing pending, ever (the fast path's reply, byte for byte the usual one)
    assert "pending" not in m and m["host_pages"] == b"" and m["disk_len"] == PAGES, m
    return m


def _exact(c, reply: dict) -> int:
    """Host pages of a load reply, each checked against what the prompt's pages hold."""
    host_pages = np.frombuffer(reply["host_pages"], dtype="<i4")
    c.sync_slabs()
    for i, slot in enumerate(host_pages):
        assert (c.arena.array[slot * PB:(slot + 1) * PB] == (SEED * 31 + i) % 251).all(), f"page {i}"
    return len(host_pages)


def test_until_complete_answers_the_whole_disk_part_at_once(daemon_factory):
    d, c, keys = _on_disk(daemon_factory)
    m = _match(c, keys)
    r = c.conn.call("load", {"pin": m["pin"], "until": "complete"}, timeout_s=30.0)
    assert "pending" not in r and r["disk_len"] == 0, r
    assert _exact(c, r) == PAGES
    c.conn.call("release", {"pin": m["pin"]}, timeout_s=30.0)
    c.close()


def test_asking_again_gets_the_whole_disk_part(daemon_factory):
    d, c, keys = _on_disk(daemon_factory)
    m = _match(c, keys)
    first = c.conn.call("load", {"pin": m["pin"], "until": "now"}, timeout_s=30.0)
    assert len(first["host_pages"]) // 4 + first["disk_len"] == PAGES, first  # what arrived, and the rest
    # best_effort: the read goes on whatever `load` answered; asking again folds in the rest
    r = wait_until(lambda: (x := c.conn.call("load", {"pin": m["pin"]}, timeout_s=30.0))["disk_len"] == 0 and x,
                   30, "the disk part to arrive")
    assert _exact(c, r) == PAGES
    c.conn.call("release", {"pin": m["pin"]}, timeout_s=30.0)
    c.close()


@pytest.mark.parametrize("bad", ["soon", "", "COMPLETE", 1, True, None, b"now", ["now"], {"until": "now"}])
def test_a_bad_until_is_refused_and_changes_nothing(bad, daemon_factory):
    d, c, keys = _on_disk(daemon_factory)
    m = _match(c, keys)
    before = admin(d.socket, "stats")
    with pytest.raises(ClientError) as e:
        c.conn.call("load", {"pin": m["pin"], "until": bad}, timeout_s=30.0)
    assert e.value.code == "BAD_PARAMS" and "until" in str(e.value), e.value
    after = admin(d.socket, "stats")
    assert after["pins"] == before["pins"] and after["tiers"]["disk"]["pages"] == before["tiers"]["disk"]["pages"]
    # the match is still held and still loads, whole and exact
    r = c.conn.call("load", {"pin": m["pin"], "until": "complete"}, timeout_s=30.0)
    assert r["disk_len"] == 0 and _exact(c, r) == PAGES
    c.conn.call("release", {"pin": m["pin"]}, timeout_s=30.0)
    c.close()
