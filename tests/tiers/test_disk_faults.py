"""DiskTier under faults, on real LMDB environments: parents before children,
damaged environments refused (and moved aside on request), a damaged B-tree
under a running tier, full and read-only directories."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import lmdb
import numpy as np
import pytest

from hicache.errors import DiskTierDamaged, DiskTierError
from hicache.tiers.disk import env as disk_env
from hicache.tiers.disk.tier import DiskTier, DiskTierConfig

from tests.tiers.test_disk import SALT_A, Done, MiB, key, page_for, toks

SIZE = 64 << 10


def _put(tier: DiskTier, i: int, parent: int | None, done: Done, **kw) -> bool:
    k = key(i)
    return tier.put_async(SALT_A, k, None if parent is None else key(parent), toks(i), page_for(k, SIZE), done,
                          **kw)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier.open(tmp_path / "disk", 16 * MiB)
    yield t
    t.close()


# ------------------------------------------------------------------ parents first

def test_a_page_is_committed_only_after_its_parent(tier):
    done = Done()
    assert _put(tier, 1, None, done)
    assert _put(tier, 2, 1, done)  # its parent earlier in the same batch: fine
    assert _put(tier, 4, 3, done)  # page 3 was never written
    assert tier.flush(60)
    assert done.results == {key(1): True, key(2): True, key(4): False}
    assert _put(tier, 3, 2, done) and _put(tier, 4, 3, done)  # now in order: both go in
    assert tier.flush(60)
    assert done.results[key(3)] and done.results[key(4)]
    st = tier.stats()
    assert st["rejected_orphan"] == 1 and st["num_pages"] == 4
    assert {r.key for r in tier.iter_meta()} == {key(i) for i in (1, 2, 3, 4)}


def test_a_child_queued_under_a_rejected_parent_is_rejected_too(tmp_path):
    with DiskTier.open(tmp_path / "disk", 3 * SIZE) as tier:  # room for three pages, no evict hook
        done = Done()
        for i in range(1, 4):
            assert _put(tier, i, i - 1 if i > 1 else None, done)
        assert _put(tier, 10, None, done)  # over budget: rejected
        assert _put(tier, 11, 10, done)  # under it, and it would fit once 10 is gone: still refused
        assert tier.flush(60)
        tier.delete_async([key(3)])
        assert _put(tier, 12, 11, done)
        assert tier.flush(60)
        assert [done.results[key(i)] for i in (1, 2, 3, 10, 11, 12)] == [True, True, True, False, False, False]
        st = tier.stats()
        assert st["rejected_budget"] == 1 and st["rejected_orphan"] == 2


def test_anchored_records_may_precede_their_parent(tier):
    done = Done()
    assert _put(tier, 7, 6, done, parent_required=False)  # e.g. a state checkpoint's anchor
    assert tier.flush(60)
    assert done.results == {key(7): True}


# ------------------------------------------------------------------ damaged environments

def _filled(path: Path, n: int = 200) -> int:
    """An environment of n chained pages; returns the bytes in use."""
    with DiskTier.open(path, 64 * MiB) as t:
        done = Done()
        for i in range(n):
            assert t.put_async(SALT_A, key(i), key(i - 1) if i else None, toks(i), page_for(key(i), 4096), done)
        assert t.flush(60)
    env = lmdb.open(str(path), readonly=True, max_dbs=4, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


@pytest.mark.parametrize("how", ["meta", "half", "zero"])
def test_a_damaged_environment_is_refused_as_damaged(tmp_path, how):
    path = tmp_path / "disk"
    used = _filled(path)
    data = path / "data.mdb"
    if how == "meta":
        with open(data, "r+b") as f:
            f.write(os.urandom(8192))
    elif how == "half":  # today: opens, then the metadata scan aborts the process in LMDB
        os.truncate(data, used // 2)
    else:
        os.truncate(data, 0)
    with pytest.raises(DiskTierDamaged):
        DiskTier.open(path, 64 * MiB)


def test_quarantine_moves_the_environment_aside_and_keeps_only_the_newest(tmp_path):
    path = tmp_path / "disk"
    _filled(path, 4)
    older = tmp_path / "disk.corrupt-20200101T000000Z"
    older.mkdir()
    (older / "data.mdb").write_bytes(b"old")
    aside = Path(disk_env.quarantine(str(path)))
    assert aside.parent == tmp_path and aside.name.startswith("disk.corrupt-") and aside != older
    assert not path.exists() and not older.exists()
    assert stat.S_IMODE(aside.stat().st_mode) == 0o700 and (aside / "data.mdb").exists()
    with DiskTier.open(path, 16 * MiB) as t:  # a fresh one in its place
        assert t.num_pages == 0


def test_quarantine_refuses_an_environment_still_open(tier, tmp_path):
    with pytest.raises(DiskTierError, match="already open"):
        disk_env.quarantine(str(tmp_path / "disk"))
    assert (tmp_path / "disk" / "data.mdb").exists()


# ------------------------------------------------------------------ a damaged B-tree at run time

def test_a_btree_damaged_under_a_running_tier_is_a_miss_and_disables_writes(tmp_path):
    cfg = DiskTierConfig(write_retry_s=3600)
    with DiskTier.open(tmp_path / "disk", 16 * MiB, config=cfg) as t:
        done = Done()
        for i in range(8):
            assert _put(t, i, i - 1 if i else None, done)
        assert t.flush(60)
        used = t.reader_health()["map_used_bytes"]
        fd = os.open(tmp_path / "disk" / "data.mdb", os.O_WRONLY)
        try:  # zero every page but the two meta pages, under the tier's shared map
            os.pwrite(fd, bytes(used - 2 * 4096), 2 * 4096)
        finally:
            os.close(fd)
        out = np.empty(SIZE, dtype=np.uint8)
        assert not t.get_into(SALT_A, key(3), out)  # today: lmdb.BadTxnError out of get_into
        assert t.stats()["corrupt_pages"] == 1
        assert t.flush(60)  # deleting the damaged entry fails even alone: writes are disabled
        st = t.stats()
        assert not st["writable"] and st["write_faults"] == 1 and st["write_fault"]
        assert not _put(t, 20, None, done)  # refused at once while disabled
        assert t.stats()["skipped_disabled"] == 1
        assert not t.get_into(SALT_A, key(4), out)  # reads still answer


# ------------------------------------------------------------------ full / read-only

def _mount(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def test_a_full_filesystem_fails_open_and_leaves_no_partial_map(tmp_path):
    mnt = tmp_path / "small"
    _mount(mnt, "4m")
    try:
        with pytest.raises(DiskTierError, match="No space left on device") as e:
            DiskTier.open(mnt / "disk", 64 * MiB)
        assert not isinstance(e.value, DiskTierDamaged)
        assert sorted(os.listdir(mnt / "disk")) == ["hicache-disk.lock"]  # today: data.mdb (160 MiB) stays
        # an existing environment whose map cannot grow keeps its old size
        with DiskTier.open(mnt / "disk", 1 * MiB, map_size=2 * MiB) as t:
            assert t.put_async(SALT_A, key(1), None, toks(1), page_for(key(1), 4096))
        size = os.path.getsize(mnt / "disk" / "data.mdb")
        with pytest.raises(DiskTierError, match="No space left on device"):
            DiskTier.open(mnt / "disk", 64 * MiB)
        assert os.path.getsize(mnt / "disk" / "data.mdb") == size
        with DiskTier.open(mnt / "disk", 1 * MiB, map_size=2 * MiB) as t:
            assert t.num_pages == 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_read_only_filesystem_is_a_clear_error_not_damage(tmp_path):
    mnt = tmp_path / "ro"
    _mount(mnt, "192m")
    try:
        _filled(mnt / "disk", 4)
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        for path in (mnt / "disk", mnt / "fresh"):
            with pytest.raises(DiskTierError, match="Read-only file system") as e:
                DiskTier.open(path, 16 * MiB)
            assert not isinstance(e.value, DiskTierDamaged)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
