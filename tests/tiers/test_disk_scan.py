"""The start-up scan of the disk tier's records (hicache/tiers/disk/scan.py) on real LMDB
environments: the C scan and the Python one give the same arrays, malformed records are
skipped, a scan in several calls misses nothing, and the verification child reads it all."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

from hicache.tiers.disk import env as disk_env
from hicache.tiers.disk import native as disk_native
from hicache.tiers.disk import scan as disk_scan
from hicache.tiers.disk import format as fmt
from hicache.tiers.disk.tier import DiskTier

SALT_A = bytes(range(16))
SALT_B = bytes(range(16, 32))
MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"k" * 12


def ntok(i: int) -> int:
    """Page i's tokens: 4 under SALT_B (every third page); under SALT_A 16, or 3 or 64 (malformed there)."""
    return 4 if i % 3 == 0 else 3 if i % 7 == 0 else 64 if i % 11 == 0 else 16


def fill(path, n: int) -> list[bytes]:
    """n pages: chains under two salts (ntok)."""
    tier = DiskTier.open(path, 64 * MiB)
    keys = []
    for i in range(n):
        salt = SALT_A if i % 3 else SALT_B
        parent = key(i - 3) if i >= 3 else None
        assert tier.put_async(salt, key(i), parent, np.arange(i, i + ntok(i), dtype=np.int32),
                              np.full(256, i % 251, np.uint8), parent_required=False)
        keys.append(key(i))
    assert tier.flush(timeout_s=60)
    tier.close()
    return keys


def add_malformed(path) -> None:
    """A record whose length does not match its token count, and one whose key is short."""
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        meta = env.open_db(fmt.DB_META, create=False)
        with env.begin(write=True) as txn:
            txn.put(b"\xff" * 16, bytes(fmt.META_HEADER_BYTES + 6), db=meta)
            txn.put(b"\x00short", bytes(fmt.META_HEADER_BYTES), db=meta)
    finally:
        env.close()


def same(a: disk_scan.MetaScan, b: disk_scan.MetaScan) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("keys", "parents", "salts", "last_access", "tok_end", "tokens"))


needs_native = pytest.mark.skipif(disk_native.LIBRARY.load() is None, reason="the disk tier's C is not built here")


@needs_native
def test_the_c_scan_reads_what_iter_meta_reads_and_skips_malformed_records(tmp_path):
    keys = fill(tmp_path / "disk", 300)
    add_malformed(tmp_path / "disk")
    tier = DiskTier.open(tmp_path / "disk", 64 * MiB)
    try:
        scan = tier.scan_meta()
        ref = disk_scan.scan_records(tier.iter_meta())
    finally:
        tier.close()
    assert same(scan, ref) and len(scan) == 300 and scan.malformed == 2
    assert sorted(scan.key_list(slice(None))) == sorted(keys)
    groups = scan.by_salt()
    assert sorted(groups) == [SALT_A, SALT_B]
    assert len(scan.key_list(groups[SALT_B])) == 100
    a = groups[SALT_A]
    good, bad = scan.rows_with(a, 16)
    odd = sorted(key(i) for i in range(300) if i % 3 and ntok(i) != 16)
    assert len(odd) > 20 and sorted(scan.key_list(bad)) == odd
    toks = scan.token_rows(good, 16)
    for k, row, (tk, parent, tokens, la) in zip(scan.key_list(good), toks, scan.tuples(good)):
        i = int.from_bytes(k[:4], "big")
        assert tk == k and np.array_equal(row, np.arange(i, i + 16)) and np.array_equal(tokens, row)
        assert parent == (key(i - 3) if i >= 3 else SALT_A) and la > 0


@needs_native
def test_a_scan_in_several_calls_misses_nothing(tmp_path, monkeypatch):
    fill(tmp_path / "disk", 500)
    monkeypatch.setattr(disk_scan, "CHUNK_RECORDS", 37)
    env = lmdb.open(str(tmp_path / "disk"), readonly=True, max_dbs=4, lock=False)
    try:
        scanner = disk_scan.native_scanner(env)
        meta = env.open_db(fmt.DB_META, create=False)
        ref = disk_scan.scan_records(disk_scan.iter_meta(env, meta))
        with env.begin() as txn:
            scan = scanner.meta(txn, fmt.DB_META, expect=0)  # arrays of 37 records: several calls, some
            # stopped early by a page of 64 tokens (room for 16 a record at first)
            assert scanner.count_keys(txn, fmt.DB_META, read_values=True) == 500
            assert scanner.count_keys(txn, fmt.DB_PAGES) == 500
    finally:
        env.close()
    assert same(scan, ref) and len(scan) == 500


def test_an_empty_tier_scans_to_nothing(tmp_path):
    tier = DiskTier.open(tmp_path / "disk", 64 * MiB)
    try:
        scan = tier.scan_meta()
    finally:
        tier.close()
    assert len(scan) == 0 and scan.by_salt() == {}


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_verification_child_reads_every_record_in_c_or_python(tmp_path, monkeypatch, native):
    fill(tmp_path / "disk", 120)
    monkeypatch.setenv("HICACHE_NATIVE_DISK", native)
    disk_native.reset()
    try:
        assert disk_env._scan(str(tmp_path / "disk")) == 240  # every meta record and every page key
        disk_env.verify(str(tmp_path / "disk"))  # the child, its own process
        disk_env.drop_scan(str(tmp_path / "disk"))  # the scan it wrote (C): no tier opened to take it
    finally:
        disk_native.reset()


@needs_native
def test_the_verification_childs_scan_is_handed_to_the_opener(tmp_path):
    fill(tmp_path / "disk", 200)
    tier = DiskTier.open(tmp_path / "disk", 64 * MiB)  # verified by a child, which scanned the records
    key = str((tmp_path / "disk").resolve())
    try:
        assert key in disk_env._scans  # waiting for scan_meta
        scan = tier.scan_meta()
        assert key not in disk_env._scans and same(scan, disk_scan.scan_records(tier.iter_meta())) and len(scan) == 200
    finally:
        tier.close()


@needs_native
def test_a_scan_read_before_a_commit_is_not_taken(tmp_path):
    fill(tmp_path / "disk", 50)
    disk_env.start_verify(str(tmp_path / "disk"))
    assert disk_env._early[str((tmp_path / "disk").resolve())].proc.wait(60) == 0  # read: 50 pages
    add_malformed(tmp_path / "disk")  # a commit after it read
    tier = DiskTier.open(tmp_path / "disk", 64 * MiB)
    try:
        scan = tier.scan_meta()  # the child's scan is older than the environment: read again
        assert len(scan) == 50 and scan.malformed == 2 and str((tmp_path / "disk").resolve()) not in disk_env._scans
    finally:
        tier.close()


def test_a_dumped_scan_loads_as_it_was(tmp_path):
    import os
    rng = np.random.default_rng(1)
    scan = disk_scan.MetaScan(rng.integers(0, 255, (7, 16), np.uint8), rng.integers(0, 255, (7, 16), np.uint8),
                              rng.integers(0, 255, (7, 16), np.uint8), rng.random(7), np.arange(1, 8) * 3,
                              rng.integers(0, 1 << 30, 21, np.int32), malformed=4)
    for s in (scan, disk_scan.scan_records([])):
        fd = os.memfd_create("t")
        try:
            disk_scan.dump(s, 1234, fd)
            got, txn = disk_scan.load(fd)
        finally:
            os.close(fd)
        assert txn == 1234 and same(got, s) and got.malformed == s.malformed
    fd = os.memfd_create("empty")
    assert disk_scan.load(fd) is None
    os.close(fd)
