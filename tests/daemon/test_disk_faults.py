"""The disk tier under faults, through a real daemon: a damaged environment is moved
aside and the daemon serves; state files are private; a read-only or full state
directory is a clear error at start and a counted degrade at run time; a page is
acknowledged on disk only once every page before it is."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
from pathlib import Path

import lmdb
import pytest

from hicache.errors import HiCacheError
from hicache.index.keys import Namespace, page_keys
from hicache.tiers.disk import format as fmt

from tests.daemon.disk_faults_util import (WAIT, DiskAcks, admin, damage, disk_settled, free_port, metrics_text,
                                           reachable_keys, remount_ro, stats, tmpfs, wait_for)
from tests.daemon.engine_worker import LAYOUTS, tokens_for
from tests.daemon.test_cycle import WORKER, run_worker

PAGE_TOKENS = 4  # LAYOUTS["mha"].page_size


def _digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.sha256(f.read(4 << 20)).hexdigest()


def _error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ 8: quarantine

@pytest.mark.parametrize("how", ["meta", "btree", "half", "zero", "garbage"])
def test_damaged_environment_is_moved_aside_and_the_daemon_serves(daemon_factory, how):
    port = free_port()
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "16MiB", "--metrics-port", str(port),
                       env=WAIT).start()
    run_worker(d.socket, *[f"store:{i}:400" for i in range(1, 5)])
    wait_for(lambda: disk_settled(d.socket, 400), 60, "400 pages on disk")
    assert d.stop() == 0
    disk = Path(d.state_dir) / "disk"
    damage(disk / "data.mdb", how)
    damaged = _digest(disk / "data.mdb")
    d.start()  # today: a traceback (lmdb.CorruptedError) or "open with reset=True", exit 1

    st = stats(d.socket)["tiers"]["disk"]
    assert st["quarantined"] == 1 and st["pages"] == 0
    aside = Path(st["quarantine_path"])
    assert aside.parent == Path(d.state_dir) and re.fullmatch(r"disk\.corrupt-\d{8}T\d{6}Z(-\d+)?", aside.name)
    assert stat.S_IMODE(aside.stat().st_mode) == 0o700
    assert _digest(aside / "data.mdb") == damaged  # kept aside as it was
    log = d.read_log()
    assert len([ln for ln in log.splitlines() if "moved aside" in ln]) == 1
    assert "Traceback" not in log
    wait_for(lambda: re.search(r'hicache_disk_faults_total\{fault="quarantined"\} 1\.0', metrics_text(port)),
             30, "the quarantine in the metrics")

    # it serves, from every tier: a new conversation reaches disk and comes back after a restart
    run_worker(d.socket, "store:9:64")
    wait_for(lambda: disk_settled(d.socket, 16), 60, "the new pages on disk")
    assert d.stop() == 0
    d.start()
    st = stats(d.socket)["tiers"]["disk"]
    assert st["quarantined"] == 0 and st["pages"] == 16
    (b,) = run_worker(d.socket, "load:9:64")
    assert b["loaded"] == 16 and b["bad_pages"] == 0 and b["host_len"] == 16
    assert aside.exists()


def test_a_page_corrupted_while_running_is_a_counted_miss_never_served(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "16MiB", env=WAIT).start()
    run_worker(d.socket, "store:5:64")
    wait_for(lambda: disk_settled(d.socket, 16), 60, "16 pages on disk")
    admin(d.socket, "flush", {"tier": "host"})  # the next load must come from disk
    # flip bytes in the middle of every page's payload, under the running daemon's map
    disk = Path(d.state_dir) / "disk"
    env = lmdb.open(str(disk), readonly=True, max_dbs=4, lock=True)
    try:
        pages = env.open_db(fmt.DB_PAGES, create=False)
        with env.begin(db=pages) as txn:
            payloads = [bytes(v) for _k, v in txn.cursor()]
    finally:
        env.close()
    assert len(payloads) == 16
    blob = (disk / "data.mdb").read_bytes()
    with open(disk / "data.mdb", "r+b") as f:
        for p in payloads:
            at = blob.find(p)
            assert at >= 0
            f.seek(at + len(p) // 2)
            f.write(bytes([blob[at + len(p) // 2] ^ 0xFF]))
    (b,) = run_worker(d.socket, "load:5:64")
    assert b["bad_pages"] == 0 and b["loaded"] == 0  # the first page fails its checksum: nothing served
    st = stats(d.socket)["tiers"]["disk"]
    assert st["corrupt_pages"] >= 1 and st["prefetch_misses"] >= 1


# ------------------------------------------------------------------ 10: private files

def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_state_files_are_private(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "16MiB", env=WAIT)
    state = Path(d.state_dir)
    state.mkdir(parents=True)
    os.chmod(state, 0o755)  # as an older daemon (or a packager) left it
    d.start()
    run_worker(d.socket, "store:3:40")
    wait_for(lambda: disk_settled(d.socket, 10), 60, "the pages on disk")
    files = [state / "namespaces.msgpack", *(state / "disk" / n for n in
                                             ("data.mdb", "lock.mdb", "hicache-disk.lock", "hicache-disk.state"))]
    assert _mode(state) == 0o700 and _mode(state / "disk") == 0o700
    assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}
    assert _mode(Path(d.socket)) == 0o660  # the socket keeps its own mode, peers are checked
    assert "tightened" in d.read_log()
    assert d.stop() == 0

    # files an older version left readable by everyone are tightened at the next start
    for f in files:
        os.chmod(f, 0o644)
    os.chmod(state / "disk", 0o755)
    os.chmod(state, 0o755)
    d.start()
    assert _mode(state) == 0o700 and _mode(state / "disk") == 0o700
    assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}
    (b,) = run_worker(d.socket, "load:3:40")
    assert b["loaded"] == 10 and b["bad_pages"] == 0


# ------------------------------------------------------------------ 11: read-only / full

@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "existing"])
def test_read_only_state_dir_is_a_clear_error_at_start(daemon_factory, existing):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "16MiB", env=WAIT)
    with tmpfs(Path(d.state_dir), "128m") as state:
        if existing:
            d.start()
            run_worker(d.socket, "store:4:40")
            assert d.stop() == 0
        remount_ro(state)
        with pytest.raises(HiCacheError):
            d.start(timeout_s=60)
        assert d.proc.returncode == 1
        log = d.read_log()
        assert "Traceback" not in log
        line = _error_line(log)
        assert line.startswith("hicache: ") and "Read-only file system" in line and "--no-disk" in line, line
        assert "moved aside" not in log  # nothing is damaged: no quarantine


def test_full_state_dir_at_start_is_a_clear_error_and_leaves_no_partial_file(daemon_factory):
    # 64 MiB of budget reserves a 160 MiB map: more than the 8 MiB filesystem
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "64MiB")
    with tmpfs(Path(d.state_dir), "8m") as state:
        with pytest.raises(HiCacheError):
            d.start(timeout_s=60)
        assert d.proc.returncode == 1
        log = d.read_log()
        assert "Traceback" not in log
        line = _error_line(log)
        assert line.startswith("hicache: ") and "No space left on device" in line, line
        assert not (state / "disk" / "data.mdb").exists()  # today: a 160 MiB file is left behind
        vfs = os.statvfs(state)
        assert vfs.f_bfree * vfs.f_frsize > 7 << 20


def _fill(path: Path) -> Path:
    """Fill the filesystem holding `path`: a file that grows until ENOSPC."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (b"\xa5" * (64 << 10), b"\xa5" * 512):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_full_state_dir_at_run_time_degrades_and_the_daemon_keeps_serving(daemon_factory):
    # a 1 MiB disk is a 1 MiB LMDB file; the rest of the 96 MiB filesystem is filled later.
    # Every page is admitted: this drives the disk past its budget (admission would turn
    # one-shot pages away once it is full, tests/daemon/test_disk_admission.py).
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "1MiB",
                       env={**WAIT, "HICACHE_DISK_ADMISSION": "all"})
    with tmpfs(Path(d.state_dir), "96m") as state:
        d.start()
        try:
            # more than the budget through the daemon: it evicts, it never fills the filesystem
            run_worker(d.socket, *[f"store:{i}:400" for i in range(1, 9)])  # 800 pages: 600 KiB + records
            wait_for(lambda: disk_settled(d.socket, 1), 60, "pages on disk")
            st = stats(d.socket)["tiers"]["disk"]
            assert st["used_bytes"] < st["bytes_written"] and st["writable"]  # it evicted
            assert (Path(d.state_dir) / "disk" / "data.mdb").stat().st_size <= 1 << 20

            filler = _fill(state)  # someone else fills the filesystem
            # new namespaces through the daemon until its own writes hit ENOSPC
            for i in range(1, 40):
                (r,) = run_worker(d.socket, "store:21:40", model=f"tenant-{i}")
                assert r["connected"]
                if stats(d.socket)["tiers"]["disk"]["degraded"]:
                    break
            st = stats(d.socket)["tiers"]["disk"]
            assert "No space left on device" in st["degraded"], st
            assert st["write_faults"] >= 1
            # host and device keep serving; what is on disk stays readable
            (b,) = run_worker(d.socket, "load:21:40", model=f"tenant-{i}")
            assert b["loaded"] == 10 and b["bad_pages"] == 0
            log = d.read_log()
            assert "Traceback" not in log
            assert len([ln for ln in log.splitlines() if "disk tier degraded" in ln]) == 1  # logged once

            filler.unlink()  # space again: the next write succeeds and the degrade ends
            run_worker(d.socket, "store:22:40", model="after-the-fault")
            wait_for(lambda: not stats(d.socket)["tiers"]["disk"]["degraded"], 30, "the degrade to end")
            wait_for(lambda: disk_settled(d.socket, 10), 60, "its pages on disk")
            assert d.stop() == 0
            d.start()  # it was saved: its pages come back from disk
            (b,) = run_worker(d.socket, "load:22:40", model="after-the-fault")
            assert b["loaded"] == 10 and b["bad_pages"] == 0 and b["host_len"] == 10
        finally:
            d.stop()


# ------------------------------------------------------------------ 14: parents first

def test_a_page_whose_parent_never_reached_disk_is_never_acknowledged(daemon_factory):
    # 800 pages of 768 B (600 KiB; 1.5 MiB with their LMDB records) do not fit a 1 MiB disk; 4 pages do
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "1MiB", env=WAIT).start()
    acks = DiskAcks(d.socket)
    try:
        run_worker(d.socket, "store:1:3200:3200", pool_pages=1024)  # one 800-page node: skipped, too big
        run_worker(d.socket, "store:2:3216:3200", pool_pages=1024)  # a 4-page child: its parent is not on disk
        run_worker(d.socket, "store:3:16")  # 4 pages under the root: fits
        salt = Namespace("test-model", LAYOUTS["mha"]).salt()
        alone = set(page_keys(salt, tokens_for(3, 16), PAGE_TOKENS))
        wait_for(lambda: alone <= acks.snapshot().get(salt.hex(), set()), 60, "the 4 root pages acknowledged")
        wait_for(lambda: disk_settled(d.socket, 4), 60, "the disk queue to drain")
        assert d.stop() == 0
    finally:
        acks.stop()
    acked = acks.snapshot().get(salt.hex(), set())
    found, unreachable = reachable_keys(Path(d.state_dir) / "disk")
    assert acked <= found.get(salt, set()), "a page acknowledged on disk is not reachable after a restart"
    assert unreachable == 0
    d.start()
    st = stats(d.socket)["tiers"]["disk"]
    assert st["orphans_dropped"] == 0 and st["pages"] == len(found[salt])


def test_every_page_acknowledged_on_disk_survives_kill9_under_write_load(daemon_factory):
    # A 1 MiB disk (the smallest allowed: a few hundred pages of 768 B with their LMDB
    # records) keeps evicting under the writes in flight, so some pages hang under a parent
    # that left the disk meanwhile.
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "1MiB", env=WAIT).start()
    acks = DiskAcks(d.socket)
    workers = []
    try:
        for w in range(3):  # three engines at once
            ops = [f"store:{w * 100 + i}:400:400" if i == 0 else
                   f"store:{w * 100 + i}:{416 + 16 * (i % 4)}:400" if i % 2 else
                   f"store:{w * 100 + i}:{64 + 8 * (i % 5)}" for i in range(80)]
            workers.append(subprocess.Popen([*WORKER, "--socket", d.socket, *ops], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        wait_for(lambda: acks.count() >= 150 or all(p.poll() is not None for p in workers), 120,
                 "150 pages acknowledged on disk")
        d.kill9()  # mid-load: the workers are still storing
    finally:
        for p in workers:
            p.kill()
            p.wait()
        acks.stop()
    acked = acks.snapshot()
    assert acks.count() >= 150, "the workers finished before 150 pages were acknowledged on disk"
    found, _unreachable = reachable_keys(Path(d.state_dir) / "disk")
    for ns, keys in acked.items():
        missing = keys - found.get(bytes.fromhex(ns), set())
        assert not missing, f"{len(missing)} of {len(keys)} pages acknowledged on disk are not reachable"
    d.start()
    st = stats(d.socket)["tiers"]["disk"]
    assert st["orphans_dropped"] == 0
    assert st["pages"] == sum(len(k) for k in found.values())

