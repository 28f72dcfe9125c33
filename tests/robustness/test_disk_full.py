"""A full disk under the state directory (a small loop-mounted ext4 or tmpfs, mounted as root).

At start: a clear one-line error and no partial files left behind. At run time: the
daemon keeps serving the host and device tiers, answers no request with INTERNAL,
and either keeps its disk tier working or switches it off and counts that.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hicache.errors import HiCacheError
from hicache.index.keys import Namespace, page_keys

from tests.robustness.contracts import disk_degraded
from tests.robustness.engines import LAYOUT, conversation, engine, load_and_check, store
from tests.robustness.proc import wait_exit
from tests.robustness.wire import served_stats

STOPS_WITHIN_S = 30.0


def _mount(args: list[str]) -> str | None:
    out = subprocess.run(["mount", *args], capture_output=True, text=True)
    return None if out.returncode == 0 else (out.stderr.strip() or f"exit {out.returncode}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 160 MiB filesystem: ext4 on a loop device (where a failed fallocate keeps the
    blocks it got, as on real disks), else a tmpfs; skipped where neither mounts."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem for the disk-full tests needs root")
    mnt = tmp_path / "smallfs"
    mnt.mkdir()
    image = tmp_path / "smallfs.img"
    why = "mkfs.ext4 not found"
    if shutil.which("mkfs.ext4"):
        with open(image, "wb") as f:
            f.truncate(160 << 20)
        mkfs = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
        why = mkfs.stderr.strip() if mkfs.returncode else _mount(["-o", "loop", str(image), str(mnt)])
    if why is not None:
        why_tmpfs = _mount(["-t", "tmpfs", "-o", "size=160m,mode=0700", "tmpfs", str(mnt)])
        if why_tmpfs is not None:
            pytest.skip(f"cannot mount a small filesystem here (ext4 loop: {why}; tmpfs: {why_tmpfs})")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(fs: Path, leave_bytes: int = 0) -> int:
    """Write a file until the filesystem has only `leave_bytes` free, or (0) until even
    a 512-byte write fails (ext4 refuses a 1 MiB write long before its last blocks go);
    the file's size."""
    st = os.statvfs(fs)
    todo = st.f_bavail * st.f_frsize - leave_bytes if leave_bytes else 1 << 62
    n, size = 0, 1 << 20
    with open(fs / "filler", "wb", buffering=0) as f:
        while n < todo and size >= 512:
            try:
                n += f.write(b"\0" * min(size, todo - n))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                size //= 2
        os.fsync(f.fileno())
    return n


def test_full_disk_at_start_is_a_clear_error_and_leaves_nothing_behind(daemon_factory, small_fs):
    fill(small_fs, leave_bytes=32 << 20)  # less than the LMDB map of a 64 MiB disk tier needs
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB")
    d.state_dir = str(small_fs / "state")
    with pytest.raises(HiCacheError) as err:
        d.start(timeout_s=60)
    log = d.read_log()
    assert "Traceback" not in log, f"the daemon died with a traceback on a full disk:\n{log[-3000:]}"
    assert d.proc is not None and d.proc.returncode not in (0, None), str(err.value)[:2000]
    last = log.strip().splitlines()[-1] if log.strip() else ""
    assert "space" in last.lower() or "ENOSPC" in last, f"the last line does not say the disk is full: {last!r}"
    # what the failed start still holds on the full filesystem (allocated blocks, not apparent size)
    leftovers = {str(p.relative_to(small_fs)): p.stat().st_blocks * 512 for p in small_fs.rglob("*")
                 if p.is_file() and p.name != "filler" and p.stat().st_blocks * 512 > (1 << 20)}
    assert not leftovers, f"a failed start on a full disk left partly reserved files behind: {leftovers}"


def test_disk_full_at_run_time_keeps_host_and_device_serving(daemon_factory, small_fs):
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "32MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete"})
    d.state_dir = str(small_fs / "state")
    d.start()
    assert d.proc is not None
    try:
        disk_before = served_stats(d.socket)["tiers"]["disk"]["pages"]
        filled = fill(small_fs)
        # a new namespace (its description must be written down) and pages to write through
        cache = engine(d.socket, model="full-disk")
        try:
            offered = [conversation(7000 + i, np.random.default_rng(i)) for i in range(8)]
            for tokens in offered:
                store(cache, tokens)
            refused = cache.client.refusals
        finally:
            cache.close()
        assert refused == 0, (f"with the disk full ({filled >> 20} MiB filler), the daemon refused {refused} of an "
                              f"engine's calls (an INTERNAL answer):\n{d.read_log()[-3000:]}")
        assert d.running, f"the daemon died when the disk filled up:\n{d.read_log()[-3000:]}"
        # host and device keep serving: another engine loads every page, byte-exact
        reader = engine(d.socket, model="full-disk")
        try:
            for tokens in offered:
                r = load_and_check(reader, tokens)
                assert r["bad_pages"] == 0, r
                assert r["loaded"] == len(tokens) // 4, (f"with the disk full, a stored conversation was not served "
                                                         f"back from host: {r}")
        finally:
            reader.close()
        # the disk tier either kept working or was switched off and that was counted
        deadline = time.monotonic() + 30
        while True:
            st = served_stats(d.socket)
            disk = st["tiers"].get("disk") or {}
            stored = disk.get("pages", 0) - disk_before
            if disk.get("queue_depth", 0) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        salt = Namespace("full-disk", LAYOUT).salt()
        want = len({k for t in offered for k in page_keys(salt, t, LAYOUT.page_size)})
        if stored < want:
            assert disk_degraded(st) >= 1, (f"{want} pages were written through to a full disk, {stored} reached "
                                            f"it, and no degrade was counted: {disk}")
        d.proc.send_signal(signal.SIGTERM)
        rc = wait_exit(d.proc, STOPS_WITHIN_S)
        assert rc == 0, f"SIGTERM with the disk full: exit {rc}:\n{d.read_log()[-3000:]}"
        assert "Traceback" not in d.read_log(), d.read_log()[-3000:]
    finally:
        d.stop(signal.SIGKILL)
