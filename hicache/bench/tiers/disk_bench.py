"""Disk tier throughput against raw py-lmdb and dd, measured side by side.

    python -m hicache.bench.tiers.disk_bench [--total-mib 512] [--repeats 5] [--sizes-kib 16,64,256,1024,4096]
        [--durabilities none,batch,sync] [--rebuild-records 1000000] [--workdir DIR]

Rows are {"name", "value", "unit", "baseline", "ratio"}; ratio = value / baseline
(higher is better for GB/s, lower for seconds). Raw py-lmdb runs under the
tier's own environment flags (writemap, sync/metasync of the durability mode)
and its batch size, alternating with the tier so that the noise of a shared
machine hits both; the median of `repeats` runs is reported.

What raw does, exactly: one named database ``pages`` (``meminit=False``);
puts are ``txn.put(key, page)`` of the same keys in the same order, from the
same 8 source pages, ``min(batch_pages, batch_bytes // size)`` per write
transaction, in one thread; gets are one read transaction per page,
``txn.get`` with ``buffers=True`` and ``np.copyto`` into the same destination
ring, in the same shuffled order. Raw does NOT write a meta record, a totals
record or a dedup lookup, computes no checksum and has no queue or writer
thread: the ratio charges the tier for all of its own work, including the
``put_many_async`` call on the producer's thread and the GIL hand-offs between it
and the writer. The tier's producer queues batches of raw's transaction size,
as many as the queue holds, and waits for an answer before queueing the next
(see ``_tier_put``), so the harness itself costs next to nothing per page.

Puts are timed from the first put to the commit of the last one: "put_fresh"
into a new environment (first-touch page faults: raw's sparse file pays for
block allocation there, the tier's map is reserved at open), "put" after
deleting those pages, so LMDB reuses them, as in a full cache that evicts as
it goes. Gets read every page once in a shuffled order and copy it into one of
64 MiB of distinct, pre-touched numpy pages (as reads land in host-arena
slots): "warm" right after the writes (page cache), "noverify" the tier with
``verify_reads=False``, to attribute the cost of the checksum. "cold": no root
here, so no drop_caches; once the environment is open the file is fsynced
and evicted with posix_fadvise(POSIX_FADV_DONTNEED), and the fraction still
resident (mincore) is reported with the row. That is this kernel's page
cache only: a virtual disk's host may still cache the blocks. The dd row
reads the same number of bytes from the same file, sequentially, after the
same eviction (``dd bs=PAGE``): the device's streaming read rate, against the
tier's shuffled page reads through the map (two B-tree lookups each, the
meta one cold as well). The random_pread row reads as many pages of the same
size from the same file at shuffled offsets with plain ``preadv``: the
device's rate for the tier's access pattern. On this VM's virtual disk that is
what bounds shuffled cold gets (2026-11-26, 128 MiB, 256 KiB-1 MiB pages, the
file evicted before each pass): the map, ``preadv`` outside the map into the
destination, ``madvise(MADV_WILLNEED)`` per page or per 32-page batch,
``posix_fadvise(WILLNEED)`` per batch and 4-16 reader threads all read
0.25-0.48 GB/s, while dd streamed the same file at 1.5-3 GB/s.

The prefetch rows read the same pages the way the daemon's disk prefetch
does: one ``get_many_async`` per chain of ``PREFETCH_CHAIN_PAGES`` pages that
were put one after another (LMDB gives such a run consecutive pages of the
file), the chains in shuffled order, after the same eviction. The seq_pread
row reads the bytes dd reads, in order, with ``preadv`` from this process into
the same destination pages: what an in-process sequential read gets against
dd. The chain_pread row reads the prefetch's pattern without the tier: one
``preadv`` per run of ``PREFETCH_CHAIN_PAGES`` consecutive pages, the runs at
shuffled places in the same bytes, after the same eviction; prefetch_vs_chain_pread
is what the tier's read path loses, chain_pread_vs_dd_read what the device gives
such runs against a sweep (docs/benchmarks.md, "Disk tier", has what these measured).

The rebuild case writes `rebuild_records` tiny-page records and times
``iter_meta`` after a reopen, then the daemon's whole rebuild of the index
(disk_rebuild_bench.py). The baselines and the tools both sides measure with
(clock, destination pages, page-cache eviction, rows) are in disk_baselines.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import threading
from collections.abc import Callable

import numpy as np

from hicache.bench.tiers.disk_baselines import (SYNC_FLAGS, Clock, dd_read, dd_write, destination_ring, drop_cache,
                                               fresh_dir, random_pread, raw_cold_get, raw_put_get, result_row,
                                               seq_pread)
from hicache.bench.tiers.disk_rebuild_bench import index_rebuild_row, iter_meta_row
from hicache.tiers.disk.tier import DEFAULT_DURABILITY, DiskTier, DiskTierConfig


def _make_pages(size: int, count: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    return [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(count)]


def _tier_put(tier: DiskTier, salt: bytes, size: int, keys: list[bytes],
              pages: list[np.ndarray]) -> tuple[float, float]:
    """Puts as fast as the queue takes them, in batches of the size raw commits
    (``put_many_async``, as the daemon's write-through queues a node's pages), as many
    in flight as the queue holds: the producer blocks on a semaphore that each batch's
    answer releases, so the writer never runs dry and the harness adds next to nothing
    per page (one Python call per batch; every result is checked after the flush)."""
    results: list[bool] = []
    cfg = tier.config
    batch = max(1, min(cfg.batch_pages, cfg.batch_bytes // size))
    room = threading.Semaphore(max(1, min(cfg.max_queue_pages // batch, cfg.max_queue_bytes // (batch * size))))
    store = np.stack(pages)  # the 8 source pages as rows; page i is row i % 8
    rows = np.arange(len(keys)) % len(pages)
    tokens = np.zeros(16 * batch, dtype=np.int32)

    def done(oks: list[bool]) -> None:
        results.extend(oks)
        room.release()

    with Clock() as put:
        for i in range(0, len(keys), batch):
            n = min(batch, len(keys) - i)
            if not room.acquire(timeout=60):
                raise RuntimeError(f"the tier wrote nothing for 60 s: {tier.stats()}")
            if tier.put_many_async(salt, keys[i:i + n], None, tokens[:16 * n], store, done, rows=rows[i:i + n],
                                   chained=False) != n:
                raise RuntimeError(f"the queue refused pages in the benchmark: {tier.stats()}")
        tier.flush()
    failed = sum(not ok for ok in results)
    if failed or len(results) != len(keys):
        raise RuntimeError(f"{failed} puts rejected, {len(keys) - len(results)} unanswered in the benchmark")
    return put.rates(len(keys) * size)


def _tier_put_twice(tier: DiskTier, salt: bytes, size: int, keys: list[bytes],
                    pages: list[np.ndarray]) -> tuple[tuple[float, float], tuple[float, float]]:
    """Puts into the fresh tier, delete all, puts again reusing the freed pages."""
    fresh = _tier_put(tier, salt, size, keys, pages)
    tier.delete_async(keys)
    for _ in range(3):  # each flush commits: the freed pages become reusable
        tier.flush()
    return fresh, _tier_put(tier, salt, size, keys, pages)


def _tier_get(tier: DiskTier, salt: bytes, size: int, keys: list[bytes], passes: int = 2) -> tuple[float, float]:
    """`passes` passes over `keys`; the last one is timed (warm: the earlier ones map the pages)."""
    outs = destination_ring(size)
    for _ in range(passes):
        with Clock() as get:
            for i, k in enumerate(keys):
                if not tier.get_into(salt, k, outs[i % len(outs)]):
                    raise RuntimeError("miss in the benchmark")
    return get.rates(len(keys) * size)


def _tier_prefetch(tier: DiskTier, salt: bytes, size: int, chains: list[list[bytes]]) -> float:
    """GB/s of the daemon's disk prefetch pattern: one ``get_many_async`` per chain
    (a prefix's pages, written one after another), the chains in the given order."""
    ring = destination_ring(size)
    n = 0
    with Clock() as get:
        for chain in chains:
            outs = [ring[(n + j) % len(ring)] for j in range(len(chain))]
            n += len(chain)
            if not all(tier.get_many_async(salt, chain, outs).result()):
                raise RuntimeError("miss in the benchmark")
    return get.rates(n * size)[0]


def _tier_get_many(tier: DiskTier, salt: bytes, size: int, keys: list[bytes], group: int = 32) -> float:
    ring = destination_ring(size)
    with Clock() as get:
        for i in range(0, len(keys), group):
            chunk = keys[i:i + group]
            outs = [ring[(i + j) % len(ring)] for j in range(len(chunk))]
            if not all(tier.get_many_async(salt, chunk, outs).result()):
                raise RuntimeError("miss in the benchmark")
    return get.rates(len(keys) * size)[0]

def _median(fn: Callable[[], float], prepare: Callable[[], None], repeats: int) -> float:
    vals = []
    for _ in range(repeats):
        prepare()
        vals.append(fn())
    return statistics.median(vals)


SIZES = tuple(k << 10 for k in (16, 64, 256, 1024, 4096))
PREFETCH_CHAIN_PAGES = 32  # pages per get_many_async in the prefetch rows (a prefix's disk part)


def run(sizes: tuple[int, ...] = SIZES, total_bytes: int = 512 << 20,
        workdir: str | None = None, repeats: int = 3, durability: str = DEFAULT_DURABILITY,
        durabilities: tuple[str, ...] = ("none", "batch", "sync"), rebuild_records: int = 1_000_000,
        config: DiskTierConfig | None = None) -> list[dict]:
    config = config or DiskTierConfig()
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="hicache-disk-bench-")
    rows: list[dict] = []
    salt = os.urandom(16)
    try:
        raw_dir, tier_dir = os.path.join(workdir, "raw"), os.path.join(workdir, "tier")
        for size in sizes:
            n = max(1, total_bytes // size)
            pages = _make_pages(size)
            keys = [os.urandom(16) for _ in range(n)]
            capacity = n * size + size
            map_size = capacity * 3 // 2 + (64 << 20)
            label = f"{size >> 10}KiB"
            m: dict[str, list[float]] = {}

            def add(name: str, value: float) -> None:
                m.setdefault(name, []).append(value)

            order = list(np.random.default_rng(1).permutation(n))
            shuffled = [keys[i] for i in order]
            chains = [keys[i:i + PREFETCH_CHAIN_PAGES] for i in range(0, n, PREFETCH_CHAIN_PAGES)]
            chains = [chains[i] for i in np.random.default_rng(3).permutation(len(chains))]
            for _ in range(repeats):  # alternate raw and tier so that noise hits both
                fresh_dir(raw_dir)
                batch = max(1, min(config.batch_pages, config.batch_bytes // size))  # the tier's limit
                fresh, (put_w, put_c), (get_w, get_c) = raw_put_get(raw_dir, size, keys, shuffled, pages,
                                                                   map_size, durability, batch)
                add("raw_fresh", fresh[0]), add("raw_put", put_w), add("raw_put_cpu", put_c)
                add("raw_get", get_w), add("raw_get_cpu", get_c)
                cold, resident = raw_cold_get(raw_dir, size, shuffled)
                add("raw_cold", cold), add("raw_resident", resident)
                shutil.rmtree(raw_dir)
                fresh_dir(tier_dir)
                with DiskTier.open(tier_dir, capacity, durability=durability, config=config) as tier:
                    fresh, (put_w, put_c) = _tier_put_twice(tier, salt, size, keys, pages)
                    add("tier_fresh", fresh[0])
                    get_w, get_c = _tier_get(tier, salt, size, shuffled)
                    add("tier_put", put_w), add("tier_put_cpu", put_c), add("tier_get", get_w)
                    add("tier_get_cpu", get_c)
                    add("tier_many", _tier_get_many(tier, salt, size, shuffled))
                noverify = dataclasses.replace(config, verify_reads=False)
                with DiskTier.open(tier_dir, capacity, durability=durability, config=noverify) as tier:
                    add("tier_get_noverify", _tier_get(tier, salt, size, shuffled)[0])
                with DiskTier.open(tier_dir, capacity, durability=durability, config=config) as tier:
                    # evicted after the open: its verification child reads every page key, and
                    # LMDB's readahead around them would warm much of the file
                    add("tier_resident", drop_cache(tier_dir))
                    add("tier_cold", _tier_get(tier, salt, size, shuffled, passes=1)[0])
                with DiskTier.open(tier_dir, capacity, durability=durability, config=config) as tier:
                    drop_cache(tier_dir)
                    add("tier_prefetch_cold", _tier_prefetch(tier, salt, size, chains))
                add("dd_read", dd_read(os.path.join(tier_dir, "data.mdb"), size, n))
                add("random_pread", random_pread(os.path.join(tier_dir, "data.mdb"), size, n))
                add("chain_pread", random_pread(os.path.join(tier_dir, "data.mdb"), size, n,
                                                PREFETCH_CHAIN_PAGES))
                add("seq_pread", seq_pread(os.path.join(tier_dir, "data.mdb"), size, n))
                shutil.rmtree(tier_dir)
            med = {k: statistics.median(v) for k, v in m.items()}
            rows.append(result_row(f"put_fresh_{label}_{durability}_tier_vs_raw_lmdb", med["tier_fresh"], "GB/s",
                                   med["raw_fresh"]))
            rows.append(result_row(f"put_{label}_{durability}_tier_vs_raw_lmdb", med["tier_put"], "GB/s",
                                   med["raw_put"]))
            rows.append(result_row(f"put_{label}_{durability}_tier_vs_raw_lmdb_per_cpu_s", med["tier_put_cpu"],
                                   "GB/cpu-s", med["raw_put_cpu"]))
            rows.append(result_row(f"get_warm_{label}_tier_vs_raw_lmdb", med["tier_get"], "GB/s", med["raw_get"]))
            rows.append(result_row(f"get_warm_{label}_tier_vs_raw_lmdb_per_cpu_s", med["tier_get_cpu"], "GB/cpu-s",
                                   med["raw_get_cpu"]))
            rows.append(result_row(f"get_warm_{label}_tier_noverify_vs_raw_lmdb", med["tier_get_noverify"], "GB/s",
                                   med["raw_get"]))
            rows.append(result_row(f"get_warm_{label}_many_{config.readers}readers_vs_raw_lmdb", med["tier_many"],
                                   "GB/s", med["raw_get"]))
            rows.append(result_row(f"get_cold_{label}_tier_vs_raw_lmdb", med["tier_cold"], "GB/s", med["raw_cold"])
                        | {"resident_after_drop": [round(med["tier_resident"], 3), round(med["raw_resident"], 3)]})
            rows.append(result_row(f"get_cold_{label}_tier_vs_dd_read", med["tier_cold"], "GB/s", med["dd_read"]))
            rows.append(result_row(f"get_cold_{label}_tier_vs_random_pread", med["tier_cold"], "GB/s",
                                   med["random_pread"]))
            rows.append(result_row(f"get_cold_{label}_prefetch_vs_dd_read", med["tier_prefetch_cold"], "GB/s",
                                   med["dd_read"]))
            rows.append(result_row(f"get_cold_{label}_prefetch_vs_seq_pread", med["tier_prefetch_cold"], "GB/s",
                                   med["seq_pread"]))
            rows.append(result_row(f"get_cold_{label}_seq_pread_vs_dd_read", med["seq_pread"], "GB/s", med["dd_read"]))
            rows.append(result_row(f"get_cold_{label}_prefetch_vs_chain_pread", med["tier_prefetch_cold"], "GB/s",
                                   med["chain_pread"]))
            rows.append(result_row(f"get_cold_{label}_chain_pread_vs_dd_read", med["chain_pread"], "GB/s",
                                   med["dd_read"]))
            dd_path = os.path.join(workdir, "dd.bin")
            dd = _median(lambda: dd_write(dd_path, size, n), lambda: None, repeats)
            rows.append(result_row(f"put_{label}_{durability}_tier_vs_dd_fdatasync", med["tier_put"], "GB/s", dd))
        if durabilities:
            rows += _durability_rows(workdir, salt, durabilities, total_bytes, repeats, config)
        if rebuild_records:
            rows.append(iter_meta_row(os.path.join(workdir, "rebuild"), salt, rebuild_records, config))
            rows.append(index_rebuild_row(os.path.join(workdir, "index-rebuild"), rebuild_records, config))
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def _durability_rows(workdir: str, salt: bytes, modes: tuple[str, ...], total_bytes: int, repeats: int,
                     config: DiskTierConfig) -> list[dict]:
    """Tier puts of 1 MiB pages under each durability mode, relative to "none"."""
    size = 1 << 20
    n = max(1, total_bytes // size)
    pages = _make_pages(size)
    keys = [os.urandom(16) for _ in range(n)]
    path = os.path.join(workdir, "dur")
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            fresh_dir(path)
            with DiskTier.open(path, n * size + size, durability=mode, config=config) as tier:
                results[mode].append(_tier_put(tier, salt, size, keys, pages)[0])
            shutil.rmtree(path)
    base = statistics.median(results["none"]) if "none" in results else None
    return [result_row(f"put_1024KiB_durability_{m}_vs_none", statistics.median(v), "GB/s", base)
            for m, v in results.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=512, help="bytes written per case (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--durability", default=DEFAULT_DURABILITY, choices=sorted(SYNC_FLAGS))
    ap.add_argument("--rebuild-records", type=int, default=1_000_000)
    ap.add_argument("--sizes-kib", default="16,64,256,1024,4096",
                    help="page sizes in KiB, comma-separated")
    ap.add_argument("--durabilities", default="none,batch,sync",
                    help="modes for the 1 MiB durability rows (empty: none of those rows)")
    args = ap.parse_args(argv)
    sizes = tuple(int(s) << 10 for s in args.sizes_kib.split(",") if s)
    modes = tuple(m for m in args.durabilities.split(",") if m)
    rows = run(sizes=sizes, total_bytes=args.total_mib << 20, workdir=args.workdir, repeats=args.repeats,
               durability=args.durability, durabilities=modes, rebuild_records=args.rebuild_records)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
