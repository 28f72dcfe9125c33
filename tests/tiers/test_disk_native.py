"""The disk writer's C put loop (hicache/tiers/disk/native.py) against the Python
loop it replaces: the same scripted batches (chains, orphans, duplicates, keys
rewritten under another namespace or size, deletions between puts, a budget the
evict hook has to make room in, a map small enough to defer, and the same cases
inside batches of put_many_async, split across transactions) leave the same
records, pages, results and counters; so do batches and the same pages put one by
one; its meta records are byte for byte what disk_format.pack_meta writes; it
stays off where it cannot be built."""

from __future__ import annotations

import threading

import lmdb
import numpy as np
import pytest

from hicache.tiers.disk import format as fmt
from hicache.tiers.disk import native as disk_native
from hicache.tiers.disk.tier import DiskTier, DiskTierConfig

SALT_A = bytes(range(16))
SALT_B = bytes(range(16, 32))
KiB = 1 << 10


def _native_available(tmp_path_factory) -> bool:
    env = lmdb.open(str(tmp_path_factory.mktemp("probe")), max_dbs=2, map_size=1 << 20)
    try:
        return disk_native.loop(env) is not None
    finally:
        env.close()


@pytest.fixture(scope="module")
def native_ok(tmp_path_factory):
    if not _native_available(tmp_path_factory):
        pytest.skip("the native disk writer cannot be built here (no C compiler or Python headers)")


def key(i: int) -> bytes:
    return b"K" + i.to_bytes(4, "big") + bytes(11)


def page(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i * 7919 + size).integers(0, 256, size, dtype=np.uint8)


class Gate:
    """The first put's on_done holds the writer until the rest of a step is queued,
    so each step is one batch whichever writer runs it."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.results: dict[bytes, list[bool]] = {}
        self.lock = threading.Lock()

    def done(self, k: bytes, ok: bool) -> None:
        with self.lock:
            self.results.setdefault(k, []).append(ok)

    def hold(self, k: bytes, ok: bool) -> None:
        self.done(k, ok)
        self.entered.set()
        self.open.wait(60)


def _step(tier: DiskTier, gate: Gate, ops: list[tuple], expand: bool) -> None:
    gate.open.clear()
    gate.entered.clear()
    tier.put_async(SALT_A, key(10_000), None, np.arange(4, dtype=np.int32), page(10_000, 4 * KiB), gate.hold)
    assert gate.entered.wait(60)  # the writer is parked after the gate's own batch
    for op in ops:
        if op[0] == "del":
            tier.delete_async(op[1])
        elif op[0] == "batch":
            _, salt, keys, parent, store, rows, chained, required = op
            toks = np.arange(16 * len(keys), dtype=np.int32).reshape(len(keys), 16) + np.array([[k[4]] for k in keys])
            if expand:  # the same pages, one put_async each
                rows = range(len(keys)) if rows is None else rows
                for i, (k, r) in enumerate(zip(keys, rows)):
                    p = keys[i - 1] if chained and i else parent
                    assert tier.put_async(salt, k, p, toks[i], store[r], gate.done, parent_required=required)
                continue

            def answer(oks: list[bool], keys: list[bytes] = keys) -> None:
                assert len(oks) == len(keys)
                for k, ok in zip(keys, oks):
                    gate.done(k, ok)
            assert tier.put_many_async(salt, keys, parent, toks, store, answer, rows=rows, chained=chained,
                                       parent_required=required) == len(keys)
        else:
            _, salt, k, parent, n_tokens, pg, required = op
            assert tier.put_async(salt, k, parent, np.arange(n_tokens, dtype=np.int32) + k[4], pg, gate.done,
                                  parent_required=required)
    gate.open.set()
    assert tier.flush(timeout_s=60)


def _script() -> list[list[tuple]]:
    sizes = [4 * KiB, 16 * KiB, 64 * KiB, 300 * KiB, 16 * KiB]
    chain = [("put", SALT_A, key(i), key(i - 1) if i % 25 else None, 16, page(i, sizes[i % 5]), True)
             for i in range(60)]
    chain.insert(30, ("put", SALT_A, key(100), key(12), 16, page(100, 16 * KiB), True))  # parent 18 back
    chain.append(("put", SALT_A, key(101), key(999), 16, page(101, 16 * KiB), True))  # an orphan
    chain.append(("put", SALT_A, key(102), key(999), 16, page(102, 16 * KiB), False))  # an anchor only
    chain.append(("put", SALT_A, key(3), key(2), 16, page(3, sizes[3]), True))  # a duplicate
    second = [
        ("put", SALT_B, key(5), None, 16, page(5, sizes[0]), True),  # same key, another namespace
        ("put", SALT_A, key(6), key(5), 16, page(6, 8 * KiB), True),  # same key, another size
        ("del", [key(7), key(8)]),
        ("put", SALT_A, key(200), key(59), 512, page(200, 64 * KiB), True),  # parent from an earlier batch
        ("put", SALT_A, key(201), key(8), 16, page(201, 16 * KiB), True),  # parent deleted just before
        ("put", SALT_A, key(202), key(200), 16, page(202, 4 * KiB), True),
    ]
    pressure = [("put", SALT_A, key(300 + i), key(299 + i) if i else None, 16, page(300 + i, 64 * KiB), True)
                for i in range(40)]
    batches = [
        _batch(SALT_A, [key(400 + i) for i in range(30)], key(59), 16 * KiB),  # a chain under an earlier page
        # a duplicate (key 1: 16 KiB, namespace A) and a rewrite (key 3 has another size) mid-batch
        _batch(SALT_A, [key(500), key(501), key(1), key(502), key(3), key(503)], key(0), 16 * KiB),
        _batch(SALT_A, [key(510 + i) for i in range(5)], key(998), 8 * KiB),  # orphans, all down the chain
        # no chain, no parent required, rows shared and out of order
        _batch(SALT_B, [key(520 + i) for i in range(4)], key(997), 4 * KiB, chained=False, required=False,
               rows=np.array([2, 0, 1, 0])),
        _batch(SALT_A, [key(1000 + i) for i in range(300)], None, 4 * KiB),  # more than a transaction takes
    ]
    batch_pressure = [_batch(SALT_A, [key(700 + i) for i in range(40)], key(420), 64 * KiB)]
    return [chain, second, pressure, batches, batch_pressure]


def _batch(salt: bytes, keys: list[bytes], parent: bytes | None, size: int, chained: bool = True,
           required: bool = True, rows: np.ndarray | None = None) -> tuple:
    store = np.stack([page(int.from_bytes(k[1:5], "big"), size) for k in keys])
    return ("batch", salt, keys, parent, store, rows, chained, required)


def _run(tmp_path, native: bool, capacity: int, map_size: int | None = None, expand: bool = False) -> dict:
    order: list[bytes] = []
    asked: list[int] = []

    def hook(bytes_needed: int) -> list[bytes]:
        asked.append(bytes_needed)
        victims = order[:4]
        del order[:4]
        return victims

    gate = Gate()
    cfg = DiskTierConfig(native_writer=native)
    with DiskTier.open(tmp_path / f"{'native' if native else 'python'}{'-expanded' if expand else ''}", capacity,
                       map_size=map_size,
                       evict_hook=hook, config=cfg) as tier:
        assert (tier._writer._native is not None) == native
        for ops in _script():
            _step(tier, gate, ops, expand)
            order[:] = sorted({r.key for r in tier.iter_meta()} - {key(10_000)})
        st = tier.stats()
        records = {r.key: (r.parent_key, r.salt, r.tokens.tolist(), r.size) for r in tier.iter_meta()}
        pages = {}
        for k, (_, salt, _, size) in records.items():
            out = np.empty(size, dtype=np.uint8)
            assert tier.get_into(salt, k, out)
            pages[k] = out.tobytes()
    counters = {k: st[k] for k in ("pages_written", "bytes_written", "dedup_puts", "rejected_budget",
                                   "rejected_orphan", "rejected_errors", "write_errors", "evicted_pages",
                                   "deleted_pages", "num_pages", "used_bytes", "deferred_batches")}
    return dict(records=records, pages=pages, results=gate.results, counters=counters, asked=asked)


@pytest.mark.parametrize("capacity,map_size", [(64 << 20, None), (3 << 20, None), (64 << 20, 6 << 20)],
                         ids=["roomy", "budget-evicts", "small-map"])
def test_native_and_python_writers_leave_the_same_tier(native_ok, tmp_path, capacity, map_size):
    native = _run(tmp_path, True, capacity, map_size)
    python = _run(tmp_path, False, capacity, map_size)
    assert native["counters"] == python["counters"]
    assert native["results"] == python["results"]
    assert native["asked"] == python["asked"]
    assert native["records"] == python["records"]
    assert native["pages"] == python["pages"]
    c = native["counters"]  # the script reached every case it is written for
    assert c["dedup_puts"] >= 2 and c["rejected_orphan"] >= 6 and c["deleted_pages"] >= 1
    assert native["results"][key(510)] == [False] and native["results"][key(514)] == [False]
    if capacity < (64 << 20) or map_size:
        assert c["evicted_pages"] > 0 and native["asked"]
    else:
        assert c["deleted_pages"] == 2 and not native["asked"]
        assert key(1299) in native["records"] and key(520) in native["records"]
        assert all(native["results"][key(i)][-1] for i in (400, 429, 500, 1, 3, 503, 520, 1000, 1299))


@pytest.mark.parametrize("capacity,map_size", [(64 << 20, None), (3 << 20, None), (64 << 20, 6 << 20)],
                         ids=["roomy", "budget-evicts", "small-map"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_batch_leaves_what_its_pages_put_one_by_one_leave(native_ok, tmp_path, native, capacity, map_size):
    """put_many_async against put_async of the same pages, in the same order: the same
    records, pages, results, evict-hook calls and counters (transactions end at the same
    pages, so deferrals and evictions fall at the same places)."""
    batched = _run(tmp_path, native, capacity, map_size)
    one_by_one = _run(tmp_path, native, capacity, map_size, expand=True)
    for part in ("counters", "results", "asked", "records", "pages"):
        assert batched[part] == one_by_one[part], part


def test_native_meta_records_are_pack_meta_byte_for_byte(native_ok, tmp_path):
    items = [(key(i), key(i - 1) if i else None, page(i, (4 + 12 * i) * KiB), np.arange(i * 3, dtype=np.int32))
             for i in range(6)]
    with DiskTier.open(tmp_path / "d", 64 << 20) as tier:
        assert tier._writer._native is not None
        for k, parent, pg, tok in items:
            assert tier.put_async(SALT_A, k, parent, tok, pg)
        assert tier.flush(timeout_s=60)
        assert tier.stats()["pages_written"] == len(items)
    env = lmdb.open(str(tmp_path / "d"), max_dbs=4, readonly=True, lock=False, subdir=True)
    try:
        meta = env.open_db(fmt.DB_META, create=False)
        with env.begin() as txn:
            for k, parent, pg, tok in items:
                raw = txn.get(k, db=meta)
                last_access = fmt.META_HEADER.unpack_from(raw)[5]
                assert raw == fmt.pack_meta(parent, SALT_A, pg.nbytes, fmt.checksum(pg), last_access,
                                            fmt.CHECKSUM_XXH3, tok.tobytes())
    finally:
        env.close()


def test_disabled_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HICACHE_NATIVE_DISK", "0")
    disk_native.reset()
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=1 << 20)
    try:
        assert disk_native.loop(env) is None
        assert disk_native.unavailable_reason() == "disabled by HICACHE_NATIVE_DISK=0"
        monkeypatch.delenv("HICACHE_NATIVE_DISK")
        disk_native.reset()  # on again: loaded where it was built
        assert (disk_native.loop(env) is None) == (disk_native.LIBRARY.load() is None)
    finally:
        env.close()


def test_an_unknown_binding_is_refused(native_ok, tmp_path):
    """The layout probe reads only inside the object and accepts nothing but a
    Transaction of the binding it knows."""
    import ctypes

    import lmdb.cpython as binding
    lib = ctypes.CDLL(binding.__file__)
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=1 << 20)
    try:
        with env.begin() as txn:
            engine, offset = disk_native.locate_txn(lib, txn, binding)
            assert engine in ("09", "10") and offset > 0
        with pytest.raises(LookupError):
            disk_native.locate_txn(lib, env, binding)  # not a Transaction
        with pytest.raises(LookupError):
            disk_native.locate_txn(lib, object(), binding)
    finally:
        env.close()


def test_lmdb_errors_keep_py_lmdb_classes(native_ok, tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=1 << 20)
    try:
        loop = disk_native.loop(env)
        assert isinstance(loop.error(-30792), lmdb.MapFullError)
        assert type(loop.error(-30798)) is lmdb.Error and "found" in str(loop.error(-30798))
    finally:
        env.close()
