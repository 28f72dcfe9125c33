"""DiskTier on real LMDB environments in temporary directories (no mocks)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import lmdb
import numpy as np
import pytest

from hicache.errors import ConfigError, DiskTierError
from hicache.tiers.disk import format as fmt
from hicache.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.wait import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SALT_A = bytes(range(16))
SALT_B = bytes(range(16, 32))
MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"k" * 12


def page_for(k: bytes, size: int) -> np.ndarray:
    """Deterministic random content derived from the key."""
    return np.random.default_rng(int.from_bytes(k, "big")).integers(0, 256, size, dtype=np.uint8)


def toks(i: int, n: int = 16) -> np.ndarray:
    return np.arange(i * n, (i + 1) * n, dtype=np.int32)


class Done:
    """Collects on_done callbacks (they arrive on the writer thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[bytes, bool] = {}

    def __call__(self, k: bytes, ok: bool) -> None:
        with self.lock:
            self.results[k] = ok


@pytest.fixture
def open_tier(tmp_path):
    opened: list[DiskTier] = []

    def factory(capacity: int = 64 * MiB, path=None, **kw) -> DiskTier:
        tier = DiskTier.open(path or tmp_path / "disk", capacity, **kw)
        opened.append(tier)
        return tier

    yield factory
    for t in opened:
        t.close()


def put_all(tier: DiskTier, items, salt=SALT_A) -> Done:
    done = Done()
    for i, (k, pg) in enumerate(items):
        assert tier.put_async(salt, k, None, toks(i), pg, done)
    assert tier.flush(timeout_s=60)
    return done


@pytest.mark.parametrize("size", [256 << 10, MiB])
@pytest.mark.parametrize("durability", ["none", "batch", "sync"])
def test_round_trip_is_byte_exact(open_tier, size, durability):
    tier = open_tier(durability=durability)
    items = [(key(i), page_for(key(i), size)) for i in range(6)]
    done = put_all(tier, items)
    assert done.results == {k: True for k, _ in items}
    out = np.empty(size, dtype=np.uint8)
    for k, pg in items:
        out[:] = 0
        assert tier.get_into(SALT_A, k, out)
        assert np.array_equal(out, pg)
    outs = [np.zeros(size, dtype=np.uint8) for _ in items]
    hits = tier.get_many_async(SALT_A, [k for k, _ in items], outs).result(timeout=60)
    assert hits == [True] * len(items)
    assert all(np.array_equal(o, pg) for o, (_, pg) in zip(outs, items))
    st = tier.stats()
    assert st["num_pages"] == 6 and st["used_bytes"] == 6 * size
    assert st["hits"] == 12 and st["corrupt_pages"] == 0 and st["bytes_read"] == 12 * size


def test_get_into_accepts_memoryview_and_other_dtypes(open_tier):
    tier = open_tier()
    pg = page_for(key(1), 64 << 10)
    put_all(tier, [(key(1), pg)])
    buf = bytearray(64 << 10)
    assert tier.get_into(SALT_A, key(1), memoryview(buf))
    assert bytes(buf) == pg.tobytes()
    halves = np.empty(32 << 10, dtype=np.float16)
    assert tier.get_into(SALT_A, key(1), halves)
    assert halves.tobytes() == pg.tobytes()


def test_missing_key_is_a_miss(open_tier):
    tier = open_tier()
    assert not tier.get_into(SALT_A, key(9), np.empty(4096, dtype=np.uint8))
    assert tier.stats()["misses"] == 1


def test_persistence_across_reopen(open_tier, tmp_path):
    tier = open_tier()
    size = 128 << 10
    parent = None
    expect = {}
    done = Done()
    for i in range(10):
        k = key(i)
        assert tier.put_async(SALT_A, k, parent, toks(i), page_for(k, size), done)
        expect[k] = (parent, toks(i))
        parent = k
    tier.close()
    assert all(done.results.values()) and len(done.results) == 10
    tier = open_tier()
    assert tier.num_pages == 10 and tier.used_bytes == 10 * size
    records = {r.key: r for r in tier.iter_meta()}
    assert set(records) == set(expect)
    for k, (parent, t) in expect.items():
        r = records[k]
        assert r.parent_key == parent and r.salt == SALT_A and r.size == size
        assert r.tokens.dtype == np.int32 and np.array_equal(r.tokens, t)
        assert r.last_access > 0
    out = np.empty(size, dtype=np.uint8)
    assert tier.get_into(SALT_A, key(3), out) and np.array_equal(out, page_for(key(3), size))


def test_iter_meta_spans_several_read_transactions(open_tier):
    tier = open_tier()
    items = [(key(i), np.full(64, i % 256, dtype=np.uint8)) for i in range(50)]
    put_all(tier, items)
    got = [r.key for r in tier.iter_meta(chunk=7)]
    assert got == sorted(k for k, _ in items)


_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    from hicache.tiers.disk.tier import DiskTier
    path, durability = sys.argv[1], sys.argv[2]
    size = 256 << 10
    salt = bytes(range(16))
    def done(k, ok):
        if ok:
            sys.stdout.write(k.hex() + "\\n")
            sys.stdout.flush()
    tier = DiskTier.open(path, 1 << 30, durability=durability)
    i = 0
    while True:
        k = i.to_bytes(4, "big") + b"k" * 12
        pg = np.random.default_rng(int.from_bytes(k, "big")).integers(0, 256, size, dtype=np.uint8)
        if tier.put_async(salt, k, None, np.arange(16, dtype=np.int32), pg, done):
            i += 1
""")


@pytest.mark.parametrize("durability", ["none", "batch"])
def test_sigkill_mid_write_leaves_a_consistent_environment(tmp_path, durability):
    path = str(tmp_path / "disk")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, durability], stdout=subprocess.PIPE,
                             env=env)
    committed: list[bytes] = []
    buf = b""
    fd = child.stdout.fileno()
    deadline = time.monotonic() + 120
    try:
        while len(committed) < 300 and time.monotonic() < deadline:
            if not select.select([fd], [], [], 1.0)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            *lines, buf = (buf + chunk).split(b"\n")
            committed += [ln for ln in lines if ln]
        os.kill(child.pid, signal.SIGKILL)  # mid-way: the child never stops writing on its own
        committed += [ln for ln in (buf + child.stdout.read()).split(b"\n") if ln]
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert len(committed) >= 300, "the child died before committing enough pages"
    size = 256 << 10
    with DiskTier.open(path, 1 << 30) as tier:
        found = {r.key for r in tier.iter_meta()}
        out = np.empty(size, dtype=np.uint8)
        for k in found:  # every page found verifies and is byte-exact
            assert tier.get_into(SALT_A, k, out)
            assert np.array_equal(out, page_for(k, size))
        assert {bytes.fromhex(h.decode()) for h in committed} <= found  # every acknowledged page survived
        assert tier.stats()["corrupt_pages"] == 0
        assert tier.num_pages == len(found) and tier.used_bytes == len(found) * size


# pages copied through numpy and through the memoryview (disk_format.copy_into)
@pytest.mark.parametrize("size,where", [(256 << 10, 0.5), (MiB + 4096, 0.5), (MiB + 4096, 0.9999), (4096, 0.5)])
def test_flipped_byte_on_disk_is_a_counted_miss_and_deleted(open_tier, tmp_path, size, where):
    tier = open_tier()
    items = [(key(i), page_for(key(i), size)) for i in range(3)]
    put_all(tier, items)
    tier.close()
    victim = items[1][1].tobytes()
    data_file = tmp_path / "disk" / "data.mdb"
    blob = data_file.read_bytes()
    start = blob.find(victim[:64])
    assert start >= 0 and blob[start:start + size] == victim, "page bytes not found in data.mdb"
    at = start + int(size * where) + 3
    with open(data_file, "r+b") as f:
        f.seek(at)
        f.write(bytes([blob[at] ^ 0x40]))
    tier = open_tier()
    out = np.empty(size, dtype=np.uint8)
    assert not tier.get_into(SALT_A, items[1][0], out)
    assert tier.stats()["corrupt_pages"] == 1
    assert tier.flush(timeout_s=60)
    assert items[1][0] not in {r.key for r in tier.iter_meta()}
    assert tier.num_pages == 2 and tier.used_bytes == 2 * size
    for k, pg in (items[0], items[2]):  # the neighbours are intact
        assert tier.get_into(SALT_A, k, out) and np.array_equal(out, pg)
    assert not tier.get_into(SALT_A, items[1][0], out)
    assert tier.stats()["corrupt_pages"] == 1  # now a plain miss


def test_full_budget_without_hook_rejects_and_recovers(open_tier):
    tier = open_tier(capacity=4 * MiB)
    items = [(key(i), page_for(key(i), MiB)) for i in range(6)]
    done = put_all(tier, items)
    assert [done.results[k] for k, _ in items] == [True] * 4 + [False] * 2
    st = tier.stats()
    assert st["rejected_budget"] == 2 and st["used_bytes"] == 4 * MiB
    tier.delete_async([items[0][0], items[1][0]])
    done = put_all(tier, items[4:])
    assert all(done.results.values())
    assert {r.key for r in tier.iter_meta()} == {k for k, _ in items[2:]}


def test_full_budget_evicts_through_the_hook(open_tier):
    order: list[bytes] = []  # LRU order, as the owner's index would know it
    asked: list[int] = []

    def hook(bytes_needed: int) -> list[bytes]:
        asked.append(bytes_needed)
        victims = []
        while order and len(victims) * MiB < bytes_needed:
            victims.append(order.pop(0))
        return victims

    tier = open_tier(capacity=4 * MiB, evict_hook=hook)
    items = [(key(i), page_for(key(i), MiB)) for i in range(7)]
    for k, _ in items:
        order.append(k)
    done = put_all(tier, items)
    assert all(done.results.values())
    assert asked and all(n > 0 for n in asked)
    assert {r.key for r in tier.iter_meta()} == {k for k, _ in items[3:]}
    assert tier.used_bytes == 4 * MiB and tier.stats()["evicted_pages"] == 3


def test_tiny_map_size_rejects_cleanly_and_keeps_the_writer_alive(open_tier):
    tier = open_tier(capacity=256 * MiB, map_size=6 * MiB)
    items = [(key(i), page_for(key(i), MiB)) for i in range(12)]
    done = put_all(tier, items)
    accepted = [k for k, _ in items if done.results[k]]
    assert 0 < len(accepted) < len(items)
    st = tier.stats()
    # the map budget turns them away before LMDB could answer MDB_MAP_FULL
    assert st["rejected_budget"] > 0 and st["write_errors"] == 0 and st["rejected_errors"] == 0
    assert {r.key for r in tier.iter_meta()} == set(accepted)
    tier.delete_async(accepted)
    assert tier.flush(timeout_s=60)
    assert tier.num_pages == 0 and tier.used_bytes == 0
    done = put_all(tier, items[:2])
    assert all(done.results.values())  # the writer is alive and space was reclaimed
    out = np.empty(MiB, dtype=np.uint8)
    assert tier.get_into(SALT_A, items[1][0], out) and np.array_equal(out, items[1][1])


def test_a_small_map_evicts_through_the_hook_before_it_is_full(open_tier):
    stored: list[bytes] = []
    tier = open_tier(capacity=256 * MiB, map_size=6 * MiB,
                     evict_hook=lambda n: [stored.pop(0) for _ in range(min(2, len(stored)))])
    done = Done()

    def on_done(k: bytes, ok: bool) -> None:
        if ok:
            stored.append(k)  # the owner indexes pages once stored
        done(k, ok)

    for i in range(12):
        assert tier.put_async(SALT_A, key(i), None, toks(i), page_for(key(i), MiB), on_done)
        assert tier.flush(timeout_s=60)  # one page per transaction
    assert all(done.results.values())
    assert tier.stats()["write_errors"] == 0  # evicted for the map's budget, before it was full
    assert tier.stats()["evicted_pages"] > 0
    assert {r.key for r in tier.iter_meta()} == set(stored)


def test_queue_full_returns_false_without_blocking(open_tier):
    tier = open_tier(config=DiskTierConfig(max_queue_pages=2))
    gate = threading.Event()
    entered = threading.Event()

    def slow_done(k: bytes, ok: bool) -> None:
        entered.set()
        gate.wait(60)  # holds the writer thread

    pg = np.zeros(4096, dtype=np.uint8)
    assert tier.put_async(SALT_A, key(0), None, toks(0), pg, slow_done)
    assert entered.wait(60)
    assert tier.put_async(SALT_A, key(1), None, toks(1), pg)
    assert tier.put_async(SALT_A, key(2), None, toks(2), pg)
    assert not tier.put_async(SALT_A, key(3), None, toks(3), pg)
    assert tier.stats()["skipped_queue_full"] == 1 and tier.stats()["queue_depth"] == 2
    gate.set()
    assert tier.flush(timeout_s=60)
    assert {r.key for r in tier.iter_meta()} == {key(0), key(1), key(2)}


def test_namespaces_are_isolated(open_tier):
    tier = open_tier()
    pg = page_for(key(1), 8192)
    put_all(tier, [(key(1), pg)], salt=SALT_A)
    out = np.empty(8192, dtype=np.uint8)
    assert not tier.get_into(SALT_B, key(1), out)
    st = tier.stats()
    assert st["misses"] == 1 and st["corrupt_pages"] == 0
    assert tier.get_into(SALT_A, key(1), out) and np.array_equal(out, pg)


def test_duplicate_put_is_deduplicated(open_tier):
    tier = open_tier()
    pg = page_for(key(1), 8192)
    done = put_all(tier, [(key(1), pg), (key(1), pg)])
    assert done.results[key(1)]
    st = tier.stats()
    assert st["dedup_puts"] == 1 and st["num_pages"] == 1 and st["used_bytes"] == 8192


def test_put_then_delete_in_one_batch_ends_deleted(open_tier):
    tier = open_tier()
    gate, entered = threading.Event(), threading.Event()

    def hold(k: bytes, ok: bool) -> None:
        entered.set()
        gate.wait(60)

    tier.put_async(SALT_A, key(0), None, toks(0), np.zeros(64, np.uint8), hold)
    assert entered.wait(60)  # the writer is held: the next two ops queue up as one batch
    tier.put_async(SALT_A, key(1), None, toks(1), np.ones(64, np.uint8))
    tier.delete_async([key(1)])
    gate.set()
    assert tier.flush(timeout_s=60)
    assert {r.key for r in tier.iter_meta()} == {key(0)}
    assert tier.num_pages == 1 and tier.stats()["deleted_pages"] == 1


def test_touch_updates_last_access(open_tier):
    tier = open_tier()
    put_all(tier, [(key(1), np.zeros(64, np.uint8))])
    before = next(tier.iter_meta()).last_access
    wait_until(lambda: time.time() > before, 10, "the wall clock to pass the stored access time")
    tier.touch([key(1), key(2)])  # key(2) is not stored: ignored
    assert tier.flush(timeout_s=60)
    after = next(tier.iter_meta()).last_access
    assert after > before


def test_bad_input_raises_and_changes_nothing(open_tier):
    tier = open_tier()
    pg = page_for(key(1), 8192)
    put_all(tier, [(key(1), pg)])
    with pytest.raises(ValueError):
        tier.put_async(SALT_A, b"short", None, toks(0), pg)
    with pytest.raises(ValueError):
        tier.put_async(SALT_A, key(2), None, np.zeros((2, 2), np.int32), pg)
    with pytest.raises(ValueError):
        tier.put_async(SALT_A, key(2), None, toks(0), b"")
    with pytest.raises(ValueError):
        tier.put_async(SALT_A, key(2), None, toks(0), np.zeros((4, 4), np.uint8)[:, ::2])
    with pytest.raises(ValueError):
        tier.get_into(SALT_A, key(1), np.empty(4096, dtype=np.uint8))  # wrong size
    with pytest.raises(ValueError):
        tier.get_into(SALT_A, key(1), b"\0" * 8192)  # read-only
    with pytest.raises(ValueError):
        tier.get_many_async(SALT_A, [key(1)], [])
    out = np.empty(8192, dtype=np.uint8)
    assert tier.get_into(SALT_A, key(1), out) and np.array_equal(out, pg)
    assert tier.stats()["puts"] == 1 and tier.stats()["corrupt_pages"] == 0


@pytest.mark.parametrize("kw", [dict(capacity_bytes=0), dict(capacity_bytes=MiB, durability="fast"),
                                dict(capacity_bytes=MiB, map_size=4096)])
def test_bad_config_is_rejected(tmp_path, kw):
    with pytest.raises(ConfigError):
        DiskTier.open(tmp_path / "disk", **kw)
    with pytest.raises(ConfigError):
        DiskTierConfig(readers=0)


def test_random_data_file_is_foreign(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    junk = os.urandom(1 << 16)
    (path / "data.mdb").write_bytes(junk)
    with pytest.raises(DiskTierError, match="not a usable LMDB"):
        DiskTier.open(path, 16 * MiB)
    assert (path / "data.mdb").read_bytes() == junk  # untouched
    with DiskTier.open(path, 16 * MiB, reset=True) as tier:
        assert tier.num_pages == 0 and list(tier.iter_meta()) == []


def test_lmdb_env_without_our_databases_is_foreign(tmp_path):
    path = tmp_path / "disk"
    env = lmdb.open(str(path), map_size=16 * MiB)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    size = (path / "data.mdb").stat().st_size
    with pytest.raises(DiskTierError, match="foreign"):
        DiskTier.open(path, 16 * MiB)
    assert (path / "data.mdb").stat().st_size == size
    with DiskTier.open(path, 16 * MiB, reset=True) as tier:
        put_all(tier, [(key(1), np.zeros(64, np.uint8))])
        assert tier.num_pages == 1


def test_other_format_version_is_refused(open_tier, tmp_path):
    tier = open_tier()
    tier.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4, map_size=1 << 30)
    info = env.open_db(fmt.DB_INFO)
    with env.begin(write=True) as txn:
        txn.put(fmt.INFO_FORMAT_KEY, fmt._INFO.pack(fmt.FORMAT_MAGIC, 99, 0, 0.0), db=info)
    env.close()
    with pytest.raises(DiskTierError, match="version 99"):
        DiskTier.open(tmp_path / "disk", 16 * MiB)


def test_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(DiskTierError, match="not a directory"):
        DiskTier.open(tmp_path / "f", MiB)


def test_second_open_is_refused(open_tier, tmp_path):
    open_tier()
    with pytest.raises(DiskTierError, match="already open"):
        DiskTier.open(tmp_path / "disk", 16 * MiB)


def test_unclean_none_env_from_another_boot_is_refused(open_tier, tmp_path):
    tier = open_tier()
    put_all(tier, [(key(1), np.zeros(64, np.uint8))])
    tier.close()
    state_file = tmp_path / "disk" / fmt.STATE_FILE
    state = json.loads(state_file.read_text())
    assert state["clean"] is True
    state.update(clean=False, boot_id="a-previous-boot")  # as if the machine died while open
    state_file.write_text(json.dumps(state))
    with pytest.raises(DiskTierError, match="torn"):
        DiskTier.open(tmp_path / "disk", 16 * MiB)
    with DiskTier.open(tmp_path / "disk", 16 * MiB, reset=True) as tier:
        assert tier.num_pages == 0


def test_reset_starts_fresh(open_tier, tmp_path):
    tier = open_tier()
    put_all(tier, [(key(i), np.zeros(64, np.uint8)) for i in range(3)])
    tier.close()
    tier = open_tier(reset=True)
    assert tier.num_pages == 0 and tier.used_bytes == 0 and list(tier.iter_meta()) == []


def test_close_drains_the_queue(open_tier):
    tier = open_tier()
    done = Done()
    for i in range(20):
        assert tier.put_async(SALT_A, key(i), None, toks(i), np.full(4096, i, np.uint8), done)
    tier.close()
    assert len(done.results) == 20 and all(done.results.values())
    assert not tier.put_async(SALT_A, key(99), None, toks(0), np.zeros(64, np.uint8))


def test_xxh3_detects_a_flipped_bit():
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 5, dtype=np.uint8)
    good = fmt.checksum(data)
    for pos in (0, 4097, len(data) - 1):
        bad = data.copy()
        bad[pos] ^= 1
        assert fmt.checksum(bad) != good


def _sum64_reference(data: bytes) -> tuple[int, int]:
    """The old sum64, written out with Python ints (independent of disk_format)."""
    data = data + bytes(-len(data) % 8)
    words = np.frombuffer(data, dtype="<u8").tolist()
    blocks = [sum(words[i:i + 512]) for i in range(0, len(words), 512)]
    return sum(blocks) % (1 << 64), sum((i + 1) * s for i, s in enumerate(blocks)) % (1 << 64)


def _swap_words(data: np.ndarray, i: int, j: int) -> np.ndarray:
    out = data.copy()
    w = out.view("<u8")
    w[i], w[j] = w[j], w[i]
    return out


def _shift_words(data: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Words lo..hi-1 moved up by one word, the last of them wrapping to lo."""
    out = data.copy()
    w = out.view("<u8")
    w[lo:hi] = np.roll(w[lo:hi], 1)
    return out


def test_swapped_and_shifted_words_are_detected_where_sum64_was_blind():
    data = np.random.default_rng(3).integers(0, 256, 64 << 10, dtype=np.uint8)
    for bad in (_swap_words(data, 3, 200), _shift_words(data, 10, 500)):  # both inside one 4 KiB block
        assert _sum64_reference(bad.tobytes()) == _sum64_reference(data.tobytes())  # the old checksum missed it
        assert fmt.checksum(bad) != fmt.checksum(data)
        assert not fmt.verify(fmt.CHECKSUM_XXH3, bad, fmt.checksum(data))


def test_swapped_words_on_disk_are_a_counted_miss(open_tier, tmp_path):
    size = 64 << 10
    tier = open_tier()
    items = [(key(i), page_for(key(i), size)) for i in range(2)]
    put_all(tier, items)
    tier.close()
    victim = items[1][1]
    data_file = tmp_path / "disk" / "data.mdb"
    blob = data_file.read_bytes()
    start = blob.find(victim.tobytes()[:64])
    assert start >= 0 and blob[start:start + size] == victim.tobytes()
    swapped = _swap_words(victim, 1000, 1001)  # two neighbouring words of one block: sum64 missed this
    with open(data_file, "r+b") as f:
        f.seek(start)
        f.write(swapped.tobytes())
    tier = open_tier()
    out = np.empty(size, dtype=np.uint8)
    assert not tier.get_into(SALT_A, items[1][0], out)
    assert tier.stats()["corrupt_pages"] == 1
    assert tier.get_into(SALT_A, items[0][0], out) and np.array_equal(out, items[0][1])


def _rewrite_as_old_record(path, k: bytes, algo: int, digest: tuple[int, int]) -> None:
    """Give page `k`'s meta record the checksum of an older build (same layout, another algo id)."""
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        meta = env.open_db(fmt.DB_META, create=False)
        with env.begin(write=True) as txn:
            rec = bytearray(txn.get(k, db=meta))
            parent, salt, size, _a, _b, last, n_tokens, _algo, flags = fmt.META_HEADER.unpack_from(rec)
            fmt.META_HEADER.pack_into(rec, 0, parent, salt, size, digest[0], digest[1], last, n_tokens, algo, flags)
            txn.put(k, bytes(rec), db=meta)
    finally:
        env.close()


@pytest.mark.parametrize("algo", [fmt.CHECKSUM_SUM64, fmt.CHECKSUM_CRC32])
@pytest.mark.parametrize("size", [8192, (64 << 10) + 100])
def test_records_of_older_builds_stay_readable(open_tier, tmp_path, algo, size):
    tier = open_tier()
    items = [(key(i), page_for(key(i), size)) for i in range(2)]
    put_all(tier, items)
    tier.close()
    for i, (k, pg) in enumerate(items):
        digest = _sum64_reference(pg.tobytes()) if algo == fmt.CHECKSUM_SUM64 else (zlib.crc32(pg), 0)
        if i == 1:  # a wrong old checksum: the page is refused, not served
            digest = (digest[0] ^ 1, digest[1])
        _rewrite_as_old_record(tmp_path / "disk", k, algo, digest)
    tier = open_tier()
    out = np.empty(size, dtype=np.uint8)
    assert tier.get_into(SALT_A, items[0][0], out) and np.array_equal(out, items[0][1])
    assert not tier.get_into(SALT_A, items[1][0], out)
    assert tier.stats()["corrupt_pages"] == 1


def test_unknown_checksum_id_is_a_malformed_record(open_tier, tmp_path):
    tier = open_tier()
    put_all(tier, [(key(1), page_for(key(1), 4096))])
    tier.close()
    _rewrite_as_old_record(tmp_path / "disk", key(1), 9, (0, 0))
    tier = open_tier()
    assert not tier.get_into(SALT_A, key(1), np.empty(4096, dtype=np.uint8))
    assert tier.stats()["corrupt_pages"] == 1


@pytest.mark.parametrize("name", ["xxh3", "auto", "sum64", "crc32"])
def test_checksum_config_names_old_and_new_write_xxh3(open_tier, tmp_path, name):
    tier = open_tier(config=DiskTierConfig(checksum=name))
    pg = page_for(key(1), 8192)
    put_all(tier, [(key(1), pg)])
    tier.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        rec = txn.get(key(1), db=env.open_db(fmt.DB_META, txn=txn, create=False))
    env.close()
    assert fmt.read_fields(memoryview(rec))[2:] == (fmt.checksum(pg), fmt.CHECKSUM_XXH3)


def test_unknown_checksum_config_is_refused():
    with pytest.raises(ConfigError, match="xxh3"):
        DiskTierConfig(checksum="md5")


def test_failing_callbacks_and_hook_do_not_kill_the_writer(open_tier):
    def bad_hook(n: int) -> list[bytes]:
        raise RuntimeError("hook bug")

    def bad_done(k: bytes, ok: bool) -> None:
        raise RuntimeError("callback bug")

    tier = open_tier(capacity=2 * MiB, evict_hook=bad_hook)
    for i in range(3):  # the third does not fit and the hook fails: rejected
        assert tier.put_async(SALT_A, key(i), None, toks(i), page_for(key(i), MiB), bad_done)
    assert tier.flush(timeout_s=60)
    assert tier.num_pages == 2 and tier.stats()["rejected_budget"] == 1
    tier.delete_async([key(0)])
    done = put_all(tier, [(key(2), page_for(key(2), MiB))])
    assert done.results == {key(2): True}


@pytest.mark.parametrize("size", [4096, 256 << 10, MiB + 5])
@pytest.mark.parametrize("algo", [fmt.CHECKSUM_XXH3, fmt.CHECKSUM_SUM64, fmt.CHECKSUM_CRC32])
def test_copy_verified_copies_and_checks(size, algo):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    want = {fmt.CHECKSUM_XXH3: fmt.checksum(src), fmt.CHECKSUM_SUM64: _sum64_reference(src.tobytes()),
            fmt.CHECKSUM_CRC32: (zlib.crc32(src), 0)}[algo]
    dst = np.zeros(size, dtype=np.uint8)
    assert fmt.copy_verified(algo, memoryview(src), memoryview(dst), want)
    assert np.array_equal(dst, src)
    assert not fmt.copy_verified(algo, memoryview(src), memoryview(dst), (want[0] ^ 1, want[1]))

