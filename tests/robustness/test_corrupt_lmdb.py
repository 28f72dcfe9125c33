"""Damaged disk-tier files at start: the daemon comes up and serves, never crash-loops.

A state directory with pages on disk is built once, then each case damages a copy of
it (truncated or garbled data.mdb, a garbled lock file or state marker, a flipped
page) and starts a daemon on it. The daemon must start and serve; either its disk
pages are all intact, or it moved the damaged environment aside (counted in stats)
and runs with an empty disk tier. No page that fails its checksum is ever served,
and the disk tier takes new pages afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from hicache.daemon.serve.launcher import LocalDaemon
from hicache.errors import HiCacheError
from hicache.index.keys import Namespace, page_keys

from tests.daemon.engine_worker import page_content
from tests.robustness.contracts import quarantined
from tests.robustness.engines import LAYOUT, conversation, engine, load_and_check, store
from tests.robustness.wire import served_stats

FLAGS = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")
ENV = {"HICACHE_LOAD_POLICY": "wait_complete"}
STARTS_WITHIN_S = 60.0


def wait_disk_idle(socket: str, min_pages: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        disk = served_stats(socket)["tiers"]["disk"]
        if (disk["pages"] >= min_pages and disk["queue_depth"] == 0) or time.monotonic() > deadline:
            return disk
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    """A stopped daemon's state directory holding a few conversations on disk."""
    work = tmp_path_factory.mktemp("pristine")
    d = LocalDaemon(work, *FLAGS, env=ENV)
    d.start()
    try:
        cache = engine(d.socket)
        convs = [conversation(500 + i, np.random.default_rng(i)) for i in range(6)]
        try:
            for tokens in convs:
                store(cache, tokens)
        finally:
            cache.close()
        disk = wait_disk_idle(d.socket, 1)
        assert disk["pages"] > 0, disk
        assert d.stop() == 0
    finally:
        d.stop(signal.SIGKILL)
    return Path(d.state_dir), convs


def _data(state: Path) -> Path:
    return state / "disk" / "data.mdb"


def used_bytes(state: Path) -> int:
    """How far into data.mdb LMDB has written pages (the rest is the reserved map)."""
    env = lmdb.open(str(state / "disk"), readonly=True, lock=False, create=False, max_dbs=8)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def truncate_to(nbytes: int | None) -> Callable[[Path], None]:
    """Cut data.mdb to `nbytes`, or (None) to half of the part LMDB wrote."""
    def damage(state: Path) -> None:
        os.truncate(_data(state), used_bytes(state) // 2 if nbytes is None else nbytes)
    return damage


def garble(name: str, offset: int, length: int) -> Callable[[Path], None]:
    def damage(state: Path) -> None:
        path = state / "disk" / name
        rng = np.random.default_rng(offset + length)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(rng.integers(0, 256, length, dtype=np.uint8).tobytes())
    return damage


def garble_tree_pages(state: Path) -> None:
    """Random bytes over the 4 KiB pages that follow the meta pages (B-tree pages)."""
    garble("data.mdb", 2 * 4096, 16 * 4096)(state)


def garble_state_marker(state: Path) -> None:
    (state / "disk" / "hicache-disk.state").write_bytes(b"\x00{not json")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "data-truncated-to-0": truncate_to(0),
    "data-truncated-to-12KiB": truncate_to(12 << 10),
    "data-truncated-to-half-its-pages": truncate_to(None),
    "data-meta-pages-garbled": garble("data.mdb", 0, 8192),
    "data-tree-pages-garbled": garble_tree_pages,
    "lock-garbled": garble("lock.mdb", 0, 4096),
    "state-marker-garbled": garble_state_marker,
}


def start_on(tmp_path: Path, state: Path) -> LocalDaemon:
    d = LocalDaemon(tmp_path / "d", *FLAGS, env=ENV)
    d.state_dir = str(state)
    try:
        d.start(timeout_s=STARTS_WITHIN_S)
    except HiCacheError as e:
        raise AssertionError(f"the daemon did not start on the damaged state: {str(e)[-2500:]}") from None
    return d


def check_serves_and_takes_new_pages(d: LocalDaemon, convs: list[np.ndarray], case: str) -> None:
    """Served bytes exact; the disk tier either whole or empty (never half a damaged
    environment); the quarantine counted in stats; new pages reach disk."""
    disk = served_stats(d.socket)["tiers"]["disk"]
    cache = engine(d.socket)
    try:
        for tokens in convs:
            r = load_and_check(cache, tokens)
            assert r["bad_pages"] == 0, f"{case}: served pages that differ from what was stored: {r}"
            if disk["pages"]:
                assert r["loaded"] == len(tokens) // LAYOUT.page_size, (
                    f"{case}: the daemon kept the environment ({disk['pages']} pages) but pages are missing: {r}")
        fresh = conversation(9999, np.random.default_rng(9999))
        store(cache, fresh)
    finally:
        cache.close()
    after = wait_disk_idle(d.socket, disk["pages"] + 1)
    assert after["pages"] > disk["pages"], f"{case}: the disk tier takes no new pages after start: {after}"
    moved_aside = quarantined(served_stats(d.socket))
    assert moved_aside in (0, 1), f"{case}: {moved_aside} environments quarantined at one start"


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_environment_at_start_is_moved_aside_or_intact(pristine, tmp_path, case):
    src, convs = pristine
    state = tmp_path / "state"
    shutil.copytree(src, state)
    DAMAGE[case](state)
    d = start_on(tmp_path, state)
    try:
        assert d.running
        check_serves_and_takes_new_pages(d, convs, case)
        assert d.stop() == 0, d.read_log()[-3000:]
        assert "Traceback" not in d.read_log(), f"{case}:\n{d.read_log()[-3000:]}"
    finally:
        d.stop(signal.SIGKILL)


def test_a_page_that_fails_its_checksum_is_never_served(pristine, tmp_path):
    src, convs = pristine
    state = tmp_path / "state"
    shutil.copytree(src, state)
    # flip one byte inside a stored page: find its first layer's K rows in the file
    tokens = convs[0]
    key = page_keys(Namespace("robust", LAYOUT).salt(), tokens, LAYOUT.page_size)[3]
    k_rows = page_content(key, 0, (LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim), torch.float16)
    needle = k_rows.view(torch.uint8).numpy().tobytes()
    blob = _data(state).read_bytes()
    at = blob.find(needle)
    assert at >= 0, "the stored page is not in data.mdb"
    with open(_data(state), "r+b") as f:
        f.seek(at + 5)
        f.write(bytes([blob[at + 5] ^ 0xFF]))
    d = start_on(tmp_path, state)
    try:
        cache = engine(d.socket)
        try:
            r = load_and_check(cache, tokens)
        finally:
            cache.close()
        assert r["bad_pages"] == 0, f"a page that fails its checksum was served: {r}"
        assert r["loaded"] == 3, f"the prefix up to the damaged page should be served, not past it: {r}"
        assert served_stats(d.socket)["tiers"]["disk"]["corrupt_pages"] >= 1
    finally:
        d.stop(signal.SIGKILL)
