"""kill -9 of the daemon at random points under write load.

Engine threads store conversations (write-through, so every page goes on to disk)
while a subscriber records which pages the daemon acknowledged as on disk (its
`stored` events of tier `disk`, sent once the LMDB commit is done, minus `removed`
disk events). At a random moment the daemon is killed with SIGKILL and restarted.
Then every acknowledged page must be found, together with its whole prefix (parents
reach disk before their children, so an acknowledged page is reachable after any
crash), and every page served must hold exactly the bytes its engine stored.
CI: 3 rounds; `--long`: 20. The state directory carries over, so later rounds also
re-check what earlier rounds acknowledged.
"""

from __future__ import annotations

import random
import threading
import time

from pathlib import Path

import numpy as np
import pytest

from tests.robustness.disk_files import committed_pages, orphans
from tests.robustness.engines import Writers, engine, load_and_check
from tests.robustness.wire import RawConn, admin_call, served_stats

SEED = 9
CI_ROUNDS = 3
LONG_ROUNDS = 20
WRITERS = 3


class DiskAcks:
    """Follows the daemon's events: the set of pages it said are on disk."""

    def __init__(self, socket: str) -> None:
        self.conn = RawConn(socket, timeout_s=10.0)
        self.conn.hello()
        reply = self.conn.call("subscribe")
        assert reply.get("result") is True, f"subscribe refused: {reply}"
        self.on_disk: set[bytes] = set()
        self.events = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.conn.sock.settimeout(None)  # until the daemon dies: EOF
        try:
            while True:
                msg = self.conn.recv(timeout_s=3600, skip_events=False)
                ev = msg.get("event")
                if not isinstance(ev, dict) or ev.get("tier") != "disk":
                    continue
                self.events += 1
                if ev.get("type") == "stored":
                    self.on_disk.update(ev["keys"])
                elif ev.get("type") == "removed":
                    self.on_disk.difference_update(ev["keys"])
        except (OSError, TimeoutError, AssertionError):
            return

    def wait_closed(self, timeout_s: float = 30.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the event subscriber still connected after the daemon was killed"
        self.conn.close()


def disk_pages_indexed(socket: str) -> int:
    return sum(ns["pages"]["disk"] for ns in admin_call(socket, "ls", {"depth": 0})["namespaces"])


# write-through: every page goes host -> disk as it is stored. write-back with a tiny host
# tier and small engine pools: device evictions back leaves up to host, host evictions
# demote them to disk while their parents may still sit on device only.
POLICIES = {
    "write_through": (("--host-capacity", "16MiB"), 512),
    "write_back": (("--host-capacity", "1MiB", "--write-policy", "write_back"), 64),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_kill9_under_write_load_loses_no_acknowledged_page_and_serves_none_corrupt(daemon_factory, long_mode,
                                                                                     policy):
    rounds = LONG_ROUNDS if long_mode else CI_ROUNDS
    flags, pool_pages = POLICIES[policy]
    rng = random.Random(SEED)
    d = daemon_factory(*flags, "--disk-capacity", "256MiB", env={"HICACHE_LOAD_POLICY": "wait_complete"}).start()
    disk_dir = Path(d.state_dir) / "disk"
    acked: set[bytes] = set()  # acknowledged on disk, over all rounds
    conversations: list[np.ndarray] = []
    pages_checked = acked_checked = committed_total = 0
    t0 = time.monotonic()
    for rnd in range(rounds):
        acks = DiskAcks(d.socket)
        acks.on_disk |= acked
        writers = Writers(d.socket, WRITERS, seed=SEED * 1000 + rnd, pool_pages=pool_pages).start()
        # a random point: early (first commits) or well into the load; a deadline, polled
        kill_after = rng.choice([rng.uniform(0.05, 0.4), rng.uniform(0.4, 2.5)])
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline and not writers.errors:
            time.sleep(0.01)
        d.kill9()
        writers.join()
        acks.wait_closed()
        assert not writers.errors, f"round {rnd}: engines failed when the daemon died: {writers.errors[:3]}"
        acked = set(acks.on_disk)
        conversations += writers.stored
        # What the disk holds now is what any crash leaves: parents must be there before children.
        committed = committed_pages(disk_dir)
        lost = orphans(committed)
        committed_total += len(committed)
        assert len(lost) == 0, (f"round {rnd} ({policy}, killed {kill_after:.2f}s into the load): {len(lost)} of "
                          f"{len(committed)} pages committed to disk have no committed parent; a rebuild "
                          f"cannot reach them ({len(lost & acked)} of them were acknowledged)")
        d.start()
        indexed = disk_pages_indexed(d.socket)
        assert indexed == len(committed), (f"round {rnd}: {len(committed)} pages were committed to disk, "
                                           f"the restarted daemon indexes {indexed}")
        # every conversation ever offered: served bytes exact; acknowledged pages all found
        cache = engine(d.socket, pool_pages=1024)
        try:
            for tokens in conversations:
                keys = cache.client.page_keys(tokens)
                r = load_and_check(cache, tokens)
                pages_checked += r["loaded"]
                assert r["bad_pages"] == 0, (f"round {rnd}: {r['bad_pages']} of {r['loaded']} pages served after "
                                             f"kill -9 differ from what was stored: {r}")
                deepest = max((i for i, k in enumerate(keys) if k in acked), default=-1)
                assert r["loaded"] >= deepest + 1, (
                    f"round {rnd} (killed {kill_after:.2f}s into the load): page {deepest} of a "
                    f"{len(keys)}-page conversation was acknowledged on disk, but after restart only "
                    f"{r['loaded']} pages of its prefix were found ({r}); "
                    f"acknowledged of this conversation: {[i for i, k in enumerate(keys) if k in acked]}")
                acked_checked += sum(1 for k in keys if k in acked)
        finally:
            cache.close()
        st = served_stats(d.socket)
        assert st["tiers"]["disk"]["corrupt_pages"] == 0, f"round {rnd}: corrupt pages on disk: {st['tiers']['disk']}"
    print(f"\nkill -9 under load ({policy}): {rounds} kills, {len(conversations)} conversations offered, "
          f"{committed_total} committed pages found on disk over the kills, {len(acked)} acknowledged at the "
          f"last one, {pages_checked} pages served and checked (0 corrupt), {acked_checked} acknowledged-page "
          f"checks, {time.monotonic() - t0:.1f}s")
