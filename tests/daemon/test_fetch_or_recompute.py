"""Fetch or recompute (hicache/daemon/core/fetch_or_recompute.py): a disk part of a match is
loaded only when reading it beats recomputing it. The rule's arithmetic in-process, then
real daemons whose disk tier measures its own reads, with engines reporting rates at both
extremes: one that computes anything faster than a read, one that computes a token a second."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hicache.client.client import HiCacheClient, Match
from hicache.client.connection import RpcConnection
from hicache.client.prefill_rate import PrefillRate
from hicache.daemon.core.fetch_or_recompute import FetchOrRecompute, TierSpeed
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.errors import ClientError
from hicache.index.keys import Namespace
from hicache.layout import KVLayout

LAYOUT = KVLayout("mha", num_layers=2, page_size=16, dtype="float16", num_kv_heads=4, head_dim=64)
PB = LAYOUT.page_bytes  # 32 KiB
PS = LAYOUT.page_size
FAST, SLOW = 1e12, 1.0  # tokens/s: faster than any read, slower than any read


# -- the rule, in-process ----------------------------------------------------------------------
def test_the_tier_fit_recovers_latency_and_bandwidth_from_reads_of_several_sizes():
    speed = TierSpeed()
    for i in range(200):  # 2 ms + 1 GB/s, reads of 1..8 MiB
        nbytes = (1 + i % 8) << 20
        speed.add(nbytes, 0.002 + nbytes / 1e9, now=float(i))
    latency, per_byte = speed.fit()
    assert latency == pytest.approx(0.002, rel=1e-3) and 1 / per_byte == pytest.approx(1e9, rel=1e-3)
    one_size = TierSpeed()  # no spread to fit a slope on: a line through the origin
    for i in range(5):
        one_size.add(1 << 20, 0.004, now=float(i))
    assert one_size.fit() == (0.0, pytest.approx(0.004 / (1 << 20)))
    for bad in ((0, 1.0), (4096, -1.0), (4096, math.nan), (4096, math.inf)):
        one_size.add(*bad, now=9.0)
    assert one_size.samples == 5


def make_engine(rate: float) -> tuple[CacheService, object]:
    svc = CacheService(HostTier(16 << 20, mlock=False))
    rec = svc.register(object(), Namespace("m", LAYOUT), device_pages=64)
    rec.prefill_tokens_per_s = rate
    return svc, rec


def test_a_part_is_loaded_when_recomputing_it_costs_more_than_reading_it():
    now = [0.0]
    rule = FetchOrRecompute(context_tokens=0, remeasure_s=10.0, clock=lambda: now[0])
    _, rec = make_engine(16_000.0)  # a page of 16 tokens: 1 ms to compute
    assert rule.worth_loading("disk", rec, 0, 8)  # never measured: loaded
    rule.observe("disk", 8 * PB, 0.004)  # 8 pages in 4 ms: 0.5 ms a page, no latency seen
    assert rule.worth_loading("disk", rec, 0, 8)  # 4 ms to read, 8 ms to compute
    rec.prefill_tokens_per_s = 64_000.0  # 0.25 ms a page
    assert not rule.worth_loading("disk", rec, 0, 8)
    assert rule.counters.skipped_pages == {"disk": 8, "remote": 0}
    assert rule.counters.skipped_tokens["disk"] == 8 * PS and rule.counters.skipped_parts == 1
    assert rule.worth_loading("remote", rec, 0, 8)  # the remote tier was never measured
    rec.prefill_tokens_per_s = 0.0  # no rate: every part loaded
    assert rule.worth_loading("disk", rec, 0, 8)
    rec.prefill_tokens_per_s = 64_000.0
    now[0] = 11.0  # the measurement is stale: read once more to measure again
    assert rule.worth_loading("disk", rec, 0, 8) and rule.counters.remeasured == 1
    rule.enabled = False
    now[0] = 0.0
    assert rule.worth_loading("disk", rec, 0, 8)
    assert rule.counters.skipped_pages["disk"] == 8


def test_deeper_tokens_cost_more_to_recompute():
    """With attention growing with the context, the same pages deep in a prompt are worth
    reading where near its start they are not."""
    rule = FetchOrRecompute(context_tokens=4096)
    _, rec = make_engine(64_000.0)
    rule.observe("disk", 8 * PB, 0.004)
    assert rule.recompute_s(64_000.0, 4096, 128) == pytest.approx(128 / 64_000.0 * (1 + (4096 + 64) / 4096))
    assert not rule.worth_loading("disk", rec, 0, 8)  # 2.1 ms to compute < 4 ms to read
    assert rule.worth_loading("disk", rec, 512, 8)  # at 8K tokens in: 6.1 ms to compute


def test_the_engine_rate_is_a_token_weighted_average_reported_when_it_moves():
    rate = PrefillRate()
    assert rate.tokens_per_s is None and rate.to_report() is None
    rate.add(1000, 0.1)
    assert rate.to_report() == pytest.approx(10_000.0)
    rate.sent(rate.to_report())
    rate.add(1000, 0.105)  # moved by less than 10%: nothing to report
    assert rate.to_report() is None
    for _ in range(30):
        rate.add(1000, 0.05)
    assert rate.to_report() == pytest.approx(20_000.0, rel=0.05)
    for bad in ((0, 1.0), (10, 0.0), (10, math.inf)):
        rate.add(*bad)
    assert PrefillRate(5e4).tokens_per_s == 5e4
    with pytest.raises(ValueError):
        PrefillRate(-1.0)


# -- real daemons ----------------------------------------------------------------------------
def prompt(seed: int, pages: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, pages * PS, dtype=np.int32)


def admin(socket: str, method: str, params: dict | None = None) -> dict:
    conn = RpcConnection.connect(socket, timeout_s=30)
    try:
        conn.hello()
        return conn.call(method, params or {}, timeout_s=60)
    finally:
        conn.close()


def to_disk_only(socket: str) -> None:
    """Every page written through to disk, then dropped from host: a match finds them on disk."""
    assert admin(socket, "settle", {"timeout_s": 30})["settled"]
    admin(socket, "evict_tier", {"tier": "host", "bytes": 1 << 40})


def fetch_stats(socket: str) -> dict:
    return admin(socket, "stats")["fetch_or_recompute"]


def store(c: HiCacheClient, toks: np.ndarray, seed: int) -> None:
    """What the vLLM connector does with a computed prompt: put its pages on host."""
    plan = c.put(toks)
    assert plan is not None and plan.put is not None and c.arena is not None
    for i, slot in enumerate(plan.host_pages):
        c.arena.array[slot * PB:(slot + 1) * PB] = (seed * 31 + plan.present + i) % 251
    assert c.put_done(plan) == len(plan.host_pages)


def lookup(c: HiCacheClient, toks: np.ndarray, seed: int) -> tuple[int, int, int]:
    """(host_len, from_disk, disk_len) of a match, every host page checked byte-exact, released."""
    m: Match = c.match(toks)
    assert c.arena is not None
    for i, slot in enumerate(m.host_pages):
        assert (c.arena.array[slot * PB:(slot + 1) * PB] == (seed * 31 + i) % 251).all(), f"page {i}"
    c.release(m)
    return m.host_len, m.from_disk, m.disk_len


def engine(socket: str, rate: float | None = None) -> HiCacheClient:
    c = HiCacheClient(LAYOUT, 64, model="m", socket_path=socket, timeout_s=30.0, prefill_tokens_per_s=rate)
    assert c.connect()
    return c


def test_match_stops_before_a_disk_part_the_engine_computes_faster(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_FETCH_REMEASURE_S": "3600"}).start()
    plain, fast, slow = engine(d.socket), engine(d.socket, FAST), engine(d.socket, SLOW)
    p = prompt(7)
    store(plain, p, 7)
    to_disk_only(d.socket)
    # the disk was never read: nothing to weigh a read with, the fast engine loads as any other
    assert lookup(fast, p, 7) == (8, 8, 0)
    fr = fetch_stats(d.socket)
    assert fr["enabled"] and fr["engines_with_rate"] == 2 and fr["tiers"]["disk"]["samples"] == 1
    assert fr["tiers"]["disk"]["bytes_per_s"] > 0 and fr["skipped_pages"]["disk"] == 0
    to_disk_only(d.socket)
    # measured now: the fast engine recomputes the 8 pages rather than wait for the disk
    hits_before = admin(d.socket, "stats")["tiers"]["disk"]["hit_rate"]
    assert lookup(fast, p, 7) == (0, 0, 0)
    fr = fetch_stats(d.socket)
    assert fr["skipped_pages"]["disk"] == 8 and fr["skipped_tokens"]["disk"] == 8 * PS
    assert fr["skipped_parts"] == 1 and fr["tiers"]["disk"]["samples"] == 1  # nothing was read
    assert admin(d.socket, "stats")["tiers"]["disk"]["hit_rate"] < hits_before  # no disk hit
    # the slow engine reads them all, and so does one that reported no rate (as before the rule)
    assert lookup(slow, p, 7) == (8, 8, 0)
    to_disk_only(d.socket)
    assert lookup(plain, p, 7) == (8, 8, 0)
    # the host part is always loaded: with the first 4 pages on host the match stops after them
    to_disk_only(d.socket)
    assert lookup(plain, p[:4 * PS], 7) == (4, 4, 0)
    assert lookup(fast, p, 7) == (4, 0, 0)
    assert fetch_stats(d.socket)["skipped_pages"]["disk"] == 12
    # an engine that measures its own prefills reports the rate (a posted call), and is heard
    to_disk_only(d.socket)
    plain.note_prefill(10**13, 1.0)
    plain.wait_posted()
    assert fetch_stats(d.socket)["engines_with_rate"] == 3
    assert lookup(plain, p, 7) == (0, 0, 0)
    assert fetch_stats(d.socket)["skipped_pages"]["disk"] == 20
    for c in (plain, fast, slow):
        c.close()


def test_the_switch_off_loads_every_page_and_still_measures(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_FETCH_OR_RECOMPUTE": "false"}).start()
    fast = engine(d.socket, FAST)
    p = prompt(9)
    store(fast, p, 9)
    for _ in range(2):
        to_disk_only(d.socket)
        assert lookup(fast, p, 9) == (8, 8, 0)
    fr = fetch_stats(d.socket)
    assert not fr["enabled"] and fr["tiers"]["disk"]["samples"] == 2 and fr["skipped_pages"]["disk"] == 0
    fast.close()


def test_a_bad_rate_is_refused_and_changes_nothing(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk").start()
    conn = RpcConnection.connect(d.socket, timeout_s=30)
    conn.hello()
    reg = {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 64}
    bad = [-1.0, math.nan, math.inf, 2e12, True, "fast", None]
    for value in bad:
        with pytest.raises(ClientError) as e:
            conn.call("register", {**reg, "prefill_tokens_per_s": value})
        assert e.value.code == "BAD_PARAMS", value
    st = conn.call("stats")
    assert st["engines"] == [] and st["fetch_or_recompute"]["engines_with_rate"] == 0
    eid = conn.call("register", {**reg, "prefill_tokens_per_s": 5e4})["engine"]
    for value in bad:
        with pytest.raises(ClientError) as e:
            conn.call("report", {"engine": eid, "prefill_tokens_per_s": value})
        assert e.value.code == "BAD_PARAMS", value
    with pytest.raises(ClientError) as e:
        conn.call("report", {"engine": eid + 1, "prefill_tokens_per_s": 1.0})
    assert e.value.code == "NOT_REGISTERED"
    assert conn.call("stats")["fetch_or_recompute"]["engines_with_rate"] == 1
    assert conn.call("report", {"engine": eid, "prefill_tokens_per_s": 0}) is True  # 0: unknown again
    assert conn.call("stats")["fetch_or_recompute"]["engines_with_rate"] == 0
    conn.close()
