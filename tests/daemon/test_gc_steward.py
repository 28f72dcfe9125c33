"""The daemon's garbage-collector steward (hicache/daemon/serve/gc_steward.py), on the real collector:
passes free young cycles and freeze survivors, CPython starts no full collection, an idle full
pass reclaims a cycle that died frozen, and stop() gives the collector back as it was."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest

from hicache.daemon.serve.gc_steward import GcSteward


class Cyclic:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def steward():
    requests = [0]
    before = gc.get_threshold()
    s = GcSteward(lambda: requests[0], interval_s=0.01, idle_s=0.05, full_interval_s=0.0)
    s.start()
    yield s, requests
    s.stop()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_pass_frees_young_cycles_and_freezes_what_lives(steward):
    s, _ = steward
    assert gc.get_threshold()[2] >= 1 << 30  # CPython never starts a full collection itself
    dead, alive = Cyclic(), Cyclic()
    dead_ref = weakref.ref(dead)
    del dead
    frozen = gc.get_freeze_count()
    s._pass()
    assert dead_ref() is None  # the cycle was collected
    assert gc.get_freeze_count() > frozen  # `alive` (and whatever else lives) is frozen now
    assert any(o is alive for o in gc.get_objects()) is False  # frozen objects are not in a generation
    assert s.passes == 1 and s.stats()["max_pass_ms"] >= 0


def test_a_cycle_that_dies_frozen_waits_for_an_idle_full_pass(steward):
    s, requests = steward
    obj = Cyclic()
    ref = weakref.ref(obj)
    s._pass()  # frozen
    del obj
    s._pass()  # a plain pass does not look at frozen objects
    assert ref() is not None

    async def run_until_full_pass() -> None:
        task = asyncio.ensure_future(s.run())
        try:
            for _ in range(500):
                if s.full_passes:
                    return
                await asyncio.sleep(0.01)
        finally:
            task.cancel()

    requests[0] += 1  # traffic, then quiet for idle_s
    asyncio.run(run_until_full_pass())
    assert s.full_passes >= 1
    assert ref() is None and s.full_pass_found >= 1


def test_traffic_holds_off_the_full_pass(steward):
    s, requests = steward
    s.idle_s = 0.5  # traffic lasts 3x this: quiet, a full pass would have run by its end; a loaded
    # machine would have to stall the loop for 0.5 s between two requests to fake a quiet spell

    async def busy() -> None:
        task = asyncio.ensure_future(s.run())
        end = time.monotonic() + 3 * s.idle_s
        try:
            while time.monotonic() < end:
                requests[0] += 1
                await asyncio.sleep(0.01)  # the traffic's pace, not a wait for a condition
        finally:
            task.cancel()

    asyncio.run(busy())
    assert s.passes > 1 and s.full_passes == 0


def test_the_interval_follows_the_pass_cost(steward):
    s, _ = steward
    s.interval_s = 0.8
    s.last_pass_s = s.target_pass_s * 2
    s._adapt()
    assert s.interval_s == 0.4
    s.last_pass_s = 0.0
    s._adapt()
    assert s.interval_s == pytest.approx(0.6)
    for _ in range(10):
        s._adapt()
    assert s.interval_s == s.max_interval_s


@pytest.mark.parametrize("managed", [True, False])
def test_the_daemon_reports_its_collector(tmp_path, managed):
    from hicache.client.connection import RpcConnection
    from hicache.daemon.serve.launcher import LocalDaemon

    env = {"HICACHE_MANAGED_GC": "1" if managed else "0"}
    with LocalDaemon(tmp_path, "--host-capacity", "64MiB", "--no-disk", env=env) as d:
        st = RpcConnection.one_call(d.socket, "stats", timeout_s=10)["gc"]
    assert st["managed"] is managed
    if managed:
        assert st["frozen_objects"] > 0 and st["startup_pass_ms"] > 0
