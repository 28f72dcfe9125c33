"""Written through means written: a fill that outruns the disk's write queue delays the
writes (the backlog, their host copies held), it never drops them, and after `settle` and
kill -9 every page `stats` counted on disk is restored. Through a real daemon filled on the
vLLM connector's path (match, put_many, copies into the arena, put_done)."""

from __future__ import annotations

import pytest

from hicache.bench.daemon.scale_workload import Engine, Workload
from hicache.client.client import CallDeadlines
from hicache.client.connection import RpcConnection

PAGES = 20_000  # 512-byte pages: the 8 MiB host holds 16k, so it evicts pages written through


def _call(sock: str, method: str, params: dict | None = None) -> dict:
    return RpcConnection.one_call(sock, method, params or {}, timeout_s=120)


def _settle(sock: str) -> None:
    for _ in range(30):  # 60 s each: a hang guard for a loaded machine, not a timing check
        if _call(sock, "settle", {"timeout_s": 60})["settled"]:
            return
    raise AssertionError("the disk writes did not settle")


# 4 pages: every write waits; 64: a step's puts (hundreds of pages) overflow it, and the old
# daemon, which refused the overflow, lost most pages and left orphans on disk at a restart
@pytest.mark.parametrize("queue_pages", [4, 64])
def test_a_fill_faster_than_the_disk_queue_is_written_whole_and_restored_after_kill9(daemon_factory, tmp_path,
                                                                                     queue_pages):
    config = tmp_path / "hicache.toml"
    config.write_text(f"disk_queue_pages = {queue_pages}\n")
    d = daemon_factory("--host-capacity", "8MiB", "--disk-capacity", "64MiB", "--config", str(config)).start()
    engine = Engine(d.socket, Workload(seed=queue_pages), deadlines=CallDeadlines.uniform(60.0))
    try:
        engine.connect()
        engine.fill(PAGES)
        engine.client.wait_posted()
    finally:
        engine.close()
    assert engine.report.outages == 0 and engine.report.skipped_puts == 0  # refused ones (no host room) may be
    _settle(d.socket)
    st = _call(d.socket, "stats")
    disk = st["tiers"]["disk"]
    assert disk["backlogged_writes"] > 0, "the fill never outran the queue: this test shows nothing"
    assert st["tiers"]["host"]["evicted_pages"] > 0, "the host never evicted a page written through"
    assert disk["skipped_writes"] == 0 and disk["backlog_pages"] == 0 and disk["queue_depth"] == 0
    assert disk["evicted_pages"] == 0  # the disk holds them all: every page stored is on it
    assert disk["pages"] == engine.report.distinct_pages

    d.kill9()
    d.start()
    after = _call(d.socket, "stats")["tiers"]["disk"]
    assert after["restored_pages"] == disk["pages"]
    assert after["orphans_dropped"] == 0 and after["unknown_ns_pages_dropped"] == 0
    assert after["pages"] == disk["pages"]
