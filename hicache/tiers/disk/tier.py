"""The disk tier (L3): KV pages in one LMDB environment that survives restarts.

Threads and ownership
- Every write runs on one writer thread (hicache/tiers/disk/writer.py: batching,
  the budget, error recovery; its queue in queue.py). ``put_async``,
  ``put_many_async`` and ``delete_async`` never block: a full queue is a
  ``False`` return (for a batch, fewer pages queued than asked; the daemon's
  write-through offers the rest again as the queue drains).
- ``put_many_async`` queues a run of pages (e.g. a radix node's) as one item,
  read from rows of one buffer, and answers it with one ``on_done(oks)``:
  neither thread runs Python per page (hicache/tiers/disk/batch.py). The
  daemon's write-through and demotion use it; ``put_async`` stays for single
  records (state checkpoints, imports).
- ``on_done`` and ``evict_hook(bytes_needed)`` run ON THE WRITER
  THREAD. An asyncio owner hops back with ``loop.call_soon_threadsafe``; the
  hook must be thread-safe (or answer from a list prepared on the loop).
  Neither may call ``flush``/``close`` (the writer would wait for itself).
- A put does not copy the page: the writer hands the caller's buffer straight
  to LMDB, so the caller keeps it unchanged until ``on_done`` fires (host-arena
  slots stay pinned until then) or passes ``bytes``.
- Reads are short read transactions (``buffers=True``): one lookup in
  ``meta`` (salt, size, checksum), one in ``pages``, then one copy from the
  map into the caller's buffer before the transaction ends, and XXH3 over
  whichever side is in the cache (the copy up to 1 MiB, the map above; see
  ``disk_format.copy_verified``). ``get_many_async`` runs them on a pool of
  ``readers`` threads; copies of 128 KiB and more release the GIL.

Keys and namespaces
- Keys are the 16-byte chained page keys of hicache/index/keys.py. The chain
  starts at the namespace salt, so two namespaces never produce the same key
  except by a 2**-128 collision; the salt is ALSO stored in each page's meta
  record and checked on every read: a read for namespace A of a key whose
  record names namespace B is a miss.

Budget
- ``capacity_bytes`` bounds the sum of stored page bytes (records and B-tree
  pages come on top: ~100 B + 4 B per token, per page). The tier never picks
  victims: a put that does not fit asks ``evict_hook(bytes_needed)`` for keys
  and is rejected (``on_done(key, False)``) when too little is freed; a full
  map or an LMDB error never kills the writer (see writer.py). A batch
  that fails with an I/O or other non-budget error even op by op disables
  writes for ``write_retry_s`` (counted, logged once; reads go on).
- ``map_size`` is the file's size: the whole map is allocated at open. The
  writer also charges every page its footprint in the map and turns away what
  would not fit (budget.py), so a small map rejects puts, never fills up.
  The daemon opens the tier with ``map_size`` = its disk capacity, so the
  file never exceeds that (hicache/daemon/movers/disk_startup.py); here the default,
  1.5 x capacity + 64 MiB, leaves room for the records of ``capacity_bytes``
  of pages.

Durability (``durability=``; the environment always uses ``writemap=True``)
- ``"none"`` (default): ``sync=False, metasync=False``; the kernel writes the
  map back on its own. A killed daemon (``kill -9``, OOM) loses nothing that
  was committed: the pages are in the page cache. A power loss or kernel crash
  can tear the environment (writemap gives no write ordering), so the tier
  records in ``hicache-disk.state`` whether it was closed cleanly and under
  which boot id; reopening an unclean ``"none"`` environment after a reboot
  raises ``DiskTierDamaged`` (the daemon moves it aside; see env.py)
  instead of trusting a possibly torn B-tree. For a cache, losing L3 after a
  power cut is cheap; paying for every commit's flush is not (numbers below).
- ``"batch"``: ``sync=True, metasync=False``: each writer batch's data is
  flushed at commit and its meta page at the next one; a power loss loses at
  most the last batch and leaves a consistent environment.
- ``"sync"``: ``sync=True, metasync=True``: ``on_done(ok=True)`` means durable.
- Measured (hicache/bench/tiers/disk_bench.py, 1 MiB pages, 512 MiB per run, median
  of 5, this shared 2-core VM): none 1.37 GB/s, batch 0.57 GB/s (0.42x), sync
  0.63 GB/s (0.46x); over seven runs batch was 0.42-0.73x and sync 0.42-0.66x
  of none (two more runs: none 1.83 / 1.89 GB/s, batch and sync 0.39-0.40x).
  Each synced commit waits for the disk (dd conv=fdatasync: ~1 GB/s here),
  while "none" writes at memory speed and lets the kernel spread the
  writeback. Since every mode survives kill -9 and the cache is disposable,
  the 2x goes to the default; ``"batch"`` is the choice for a daemon that must
  keep its L3 across power cuts.
- ``writemap=True`` because LMDB puts of 256 KiB-2 MiB values are ~2-3x
  faster with it (LIMITS.md). Its hazard is SIGBUS when a write lands in a
  sparse hole of a full disk, so ``open`` reserves the whole map with
  ``posix_fallocate``: a full disk then fails ``open`` with ``DiskTierError``
  (and no half-allocated file left behind) instead of killing the daemon
  later, and LMDB itself never needs more space at run time.

Throughput against raw py-lmdb (disk_bench: same flags, batches, keys and
order; raw writes no meta record, computes no checksum and has no writer
thread), durability "none", 512 MiB per case, median of 5, this shared 2-vCPU
VM at load ~4 (2026-11-25; README "hicache bench disk" has the table):
warm verified gets 0.68 / 1.19 / 0.84 / 0.84 / 0.77 of raw for 16 KiB / 64 KiB
/ 256 KiB / 1 MiB / 4 MiB pages, puts into freed pages 0.23 / 0.53 / 0.59 /
0.74 / 0.73 (a second run: gets 0.73-1.14, puts 0.25-0.59). What is left is
work raw does not do: per page, a meta lookup and put, ~3 us of put_async on
the producer's thread, the writer's Python per page (taking the batch,
on_done) and, on the Python loop, GIL hand-offs (py-lmdb drops the GIL in
every call; the writer's txn.put of a 64 KiB page averaged ~13 us, waiting for
the producer, against ~6 us for raw's whole put); per byte, the XXH3 pass (~60
GB/s, against raw puts at 12-16 GB/s from cache-hot sources: 20-25% more CPU
for 1-4 MiB pages on its own). Runs of puts under 1 MiB therefore go through
a C loop with the GIL released (native.py): the writer's CPU per 16 KiB
page fell by ~45% (docs/benchmarks.md, 2026-11-26); batches (``put_many_async``)
then took the Python per page off both threads: puts 0.42-0.58 / 0.66-0.70 /
0.71-1.0 of raw per CPU-second at 16 / 64 / 256 KiB, the rest being the meta
record's second B-tree insert and XXH3 (docs/benchmarks.md). Cold gets run at the device's
random-read rate (disk_bench's ``random_pread`` row): reads outside the map and
``madvise``/``fadvise`` readahead measured no faster (docs/benchmarks.md). A prefetch's
chain lies in consecutive pages of the file, but looking a batch up first and reading
it in file order (through the map or with ``preadv``) measured no faster than this
path either: on this disk a range read from mid-file runs at a third to a half of a
sequential sweep (docs/benchmarks.md, "Cold reads against dd"), and one
``madvise(WILLNEED)`` per run of a batch before copying was no robust win ("Cold
reads, second pass": the map's read-around already reads 8 MiB windows here).

The environment is meant for one owner process: ``open`` takes an exclusive
``flock`` on ``hicache-disk.lock`` and a second opener gets ``DiskTierError``.
Never carry an open tier across ``fork``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import lmdb
import numpy as np

from hicache.errors import ConfigError, DiskTierError
from hicache.tiers.disk import env as disk_env
from hicache.tiers.disk import scan as disk_scan
from hicache.tiers.disk import format as fmt
from hicache.tiers.disk.batch import BatchDone, make_batch
from hicache.tiers.disk.config import DiskTierConfig
from hicache.tiers.disk.format import DiskRecord
from hicache.tiers.disk.ops import OnDone
from hicache.tiers.disk.writer import DiskWriter, EvictHook

log = logging.getLogger(__name__)

_xxh3 = fmt.xxh3_64
_XXH3 = fmt.CHECKSUM_XXH3
_HASH_DST_BYTES = fmt.HASH_DST_BYTES
_INT32 = np.dtype("<i4")
_UINT8 = np.dtype(np.uint8)

__all__ = ["DiskTier", "DiskTierConfig", "DiskRecord", "Durability", "DEFAULT_DURABILITY"]

Durability = Literal["none", "batch", "sync"]
DEFAULT_DURABILITY: Durability = "none"


def _readable_bytes(page: object) -> memoryview:
    try:
        mv = memoryview(page)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"page must be a bytes-like object, got {type(page).__name__}") from e
    if not mv.c_contiguous:
        raise ValueError("page must be C-contiguous")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.nbytes == 0:
        raise ValueError("page is empty")
    return mv


def _writable_bytes(out: object) -> memoryview:
    """A flat writable byte view of `out` (a memoryview copy is cheaper per call
    than numpy's for small pages and the same memcpy for big ones)."""
    try:
        mv = memoryview(out)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"out must be a writable buffer, got {type(out).__name__}") from e
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("out must be a writable C-contiguous buffer")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class DiskTier:
    """KV pages on disk under a byte budget. Build it with ``DiskTier.open``."""

    def __init__(self, opened: disk_env.OpenedEnv, capacity_bytes: int, durability: Durability,
                 config: DiskTierConfig, evict_hook: EvictHook | None) -> None:
        self.path = opened.path
        self.capacity_bytes = capacity_bytes
        self.map_size = opened.map_size
        self.durability = durability
        self.config = config
        self._env = env = opened.env
        self._lock_fd = opened.lock_fd
        self._pages = env.open_db(fmt.DB_PAGES, create=False)
        self._meta = env.open_db(fmt.DB_META, create=False)
        info = env.open_db(fmt.DB_INFO, create=False)
        self._closed = False
        # Reader counters, guarded by _rlock.
        self._rlock = threading.Lock()
        self._r = dict(hits=0, misses=0, corrupt_pages=0, bytes_read=0)  # gets = hits + misses
        self._readers = ThreadPoolExecutor(config.readers, thread_name_prefix="hicache-disk-read")
        self._writer = DiskWriter(env, self.path, pages=self._pages, meta=self._meta, info=info,
                                  capacity_bytes=capacity_bytes, map_size=opened.map_size, config=config,
                                  evict_hook=evict_hook,
                                  used_bytes=opened.used_bytes, num_pages=opened.num_pages)
        self._queue = self._writer.queue

    # ----------------------------------------------------------------- open/close

    @classmethod
    def open(cls, path: str | os.PathLike[str], capacity_bytes: int, *, map_size: int | None = None,
             reset: bool = False, durability: Durability = DEFAULT_DURABILITY,
             evict_hook: EvictHook | None = None, config: DiskTierConfig | None = None) -> DiskTier:
        """Open or create the tier in directory `path`.

        Raises ``DiskTierDamaged`` for a foreign, damaged or torn environment
        (``reset=True`` deletes the environment's files first; an owner may move
        them aside with ``disk_env.quarantine``), ``DiskTierError`` for a busy or
        unusable directory (read-only, full: see env.py) and
        ``ConfigError`` for bad arguments.
        """
        config = config or DiskTierConfig()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if durability not in fmt.SYNC_FLAGS:
            raise ConfigError(f"durability must be one of {sorted(fmt.SYNC_FLAGS)}, got {durability!r}")
        if map_size is None:
            map_size = capacity_bytes * 3 // 2 + (64 << 20)
        if map_size < (1 << 20):
            raise ConfigError(f"map_size must be >= 1 MiB, got {map_size}")
        map_size = -(-map_size // 4096) * 4096
        opened = disk_env.open_environment(os.fspath(path), map_size, durability, reset=reset,
                                           max_spare_txns=config.readers + 1)
        try:
            return cls(opened, capacity_bytes, durability, config, evict_hook)
        except BaseException:
            opened.env.close()
            os.close(opened.lock_fd)
            raise

    def close(self) -> None:
        """Drain the queue, commit, flush to disk, mark the environment clean. Idempotent."""
        if not self._writer.stop():
            return
        self._readers.shutdown(wait=True)
        try:
            self._env.sync(True)
            disk_env.write_state(self.path, clean=True, durability=self.durability)
        except (lmdb.Error, OSError) as e:
            log.error("disk tier %s: final sync failed: %s", self.path, e)
        self._closed = True
        self._env.close()
        os.close(self._lock_fd)
        disk_env.drop_scan(self.path)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        """Install the owner's victim chooser (called on the writer thread)."""
        self._writer.evict_hook = hook

    # --------------------------------------------------------------------- writes

    def put_async(self, salt: bytes, key: bytes, parent_key: bytes | None, tokens: object,
                  page: object, on_done: OnDone | None = None, *, parent_required: bool = True) -> bool:
        """Queue one page for writing; False (counted) when the queue is full, the
        tier is closing or its writes are disabled after a fault. Never blocks.
        ``on_done(key, ok)`` fires on the writer thread after the commit (or the
        rejection).

        Parents first: with ``parent_required`` a page is committed only if its
        parent's record is on disk (committed before, or earlier in the same
        transaction), and rejected otherwise (``rejected_orphan``). So a page
        acknowledged by ``on_done(key, True)`` is reachable from its namespace
        after any crash, and a page queued under a parent whose write failed is
        refused too. Pass False for records whose ``parent_key`` only anchors
        them (state checkpoints name a KV page of another salt)."""
        if type(salt) is not bytes or type(key) is not bytes or len(salt) != 16 or len(key) != 16:
            fmt.check_key("salt", salt)  # the message (this path is hot: one test when all is well)
            fmt.check_key("key", key)
        if parent_key is not None:
            fmt.check_key("parent_key", parent_key)
        if type(tokens) is np.ndarray and tokens.dtype == _INT32 and tokens.ndim == 1:
            tok_bytes = tokens.tobytes()  # the common case: no conversion
        else:
            tok = np.asarray(tokens)
            if tok.ndim != 1 or tok.dtype.kind not in "iu":
                raise ValueError("tokens must be a one-dimensional integer array")
            tok_bytes = tok.astype("<i4", copy=False).tobytes()
        if type(page) is np.ndarray and page.dtype == _UINT8 and page.ndim == 1 and page.size \
                and page.flags.c_contiguous:
            mv = memoryview(page)  # the common case: already flat bytes
        else:
            mv = _readable_bytes(page)
        return self._queue.put(salt, key, parent_key, tok_bytes, mv, on_done, parent_required)

    def put_many_async(self, salt: bytes, keys: Sequence[bytes], parent_key: bytes | None, tokens: object,
                       pages: object, on_done: BatchDone | None = None, *, rows: object = None,
                       chained: bool = True, parent_required: bool = True, count_refused: bool = True) -> int:
        """Queue ``len(keys)`` pages as one item (hicache/tiers/disk/batch.py): ``put_async``
        for each, in order, without Python per page on either thread. Returns how many of
        the first pages were queued (the rest did not fit the queue, or writes are disabled
        or closing: counted as ``put_async``'s refusals); 0 queues nothing.

        ``pages`` is one C-contiguous 2-D buffer whose rows are pages (e.g. an arena viewed
        as ``(slots, page_bytes)``); page i is row ``rows[i]`` (default: row i). Like
        ``put_async`` it is not copied: keep those rows unchanged until ``on_done``.
        ``tokens`` holds the same number of tokens for every page, page after page (1-D)
        or one row per page (2-D). With ``chained`` page i > 0 has page i - 1 as parent
        and page 0 ``parent_key``; otherwise every page has ``parent_key``.
        ``on_done(oks)`` fires once, on the writer thread, after the last queued page's
        commit (or rejection), with one bool per queued page. A caller that offers the
        pages not queued again later passes ``count_refused=False``: they are then not
        counted as refused (skipped), the caller counts those it gives up."""
        batch = make_batch(salt, keys, parent_key, tokens, pages, on_done, rows, chained, parent_required)
        return self._queue.put_many(batch, count_refused)

    def delete_async(self, keys: Iterable[bytes]) -> None:
        """Queue deletions (not bounded by the queue limits: they carry no pages)."""
        batch = [fmt.check_key("key", k) for k in keys]
        if batch:
            self._queue.delete(batch)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Note an access; persisted lazily, every ``touch_interval_s``."""
        self._queue.touch(keys)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until everything queued so far is committed (and touches
        applied); False on timeout. For shutdown and tests, not the event loop."""
        return self._writer.flush(timeout_s)

    # ---------------------------------------------------------------------- reads

    def get_into(self, salt: bytes, key: bytes, out: object) -> bool:
        """Copy page `key` of namespace `salt` into `out`; False on a miss.

        A checksum or size mismatch, or an LMDB error (a damaged B-tree), is a
        miss too: counted as corrupt and the entry is deleted, so False means
        "not on disk (any more)"; a page that fails its checksum is never
        served (unless ``verify_reads`` is off). On False
        the content of `out` is unspecified. Raises ValueError if `out` does
        not have the stored page's size (a caller error; nothing changes).
        """
        if type(salt) is not bytes or type(key) is not bytes or len(salt) != 16 or len(key) != 16:
            fmt.check_key("salt", salt)  # the message (this path is hot: one test when all is well)
            fmt.check_key("key", key)
        dst = _writable_bytes(out)
        if self._closed:
            raise DiskTierError(f"{self.path}: disk tier is closed")
        n = dst.nbytes
        fields = None
        status = "miss"
        try:
            with self._env.begin(buffers=True) as txn:
                raw = txn.get(key, db=self._meta)
                if raw is not None:
                    fields = fmt.read_fields(raw)
                    if fields is None:
                        status = "corrupt"
                    elif fields[0] != salt:
                        status = "miss"  # another namespace's page
                    elif fields[1] != n:
                        status = "size"
                    else:
                        page = txn.get(key, db=self._pages)
                        if page is None or len(page) != n:
                            status = "corrupt"
                        elif not self.config.verify_reads:  # copy before the view dies with the transaction
                            fmt.copy_into(dst, page)
                            status = "hit"
                        elif fields[3] == _XXH3 and n <= _HASH_DST_BYTES:  # the common case, inlined:
                            fmt.copy_into(dst, page)  # copy, then hash the copy while it is in L2
                            status = "hit" if (_xxh3(dst), 0) == fields[2] else "corrupt"
                        else:
                            status = "hit" if fmt.copy_verified(fields[3], page, dst, fields[2]) else "corrupt"
        except lmdb.Error as e:  # MDB_CORRUPTED / MDB_PAGE_NOTFOUND: the B-tree under this key is damaged
            self._writer.warn("reading page %s failed: %s", key.hex(), e)
            status = "corrupt"
        if status == "hit":
            with self._rlock:
                r = self._r
                r["hits"] += 1
                r["bytes_read"] += n
            return True
        if status == "size":
            raise ValueError(f"out has {n} bytes, page {key.hex()} has {fields[1]}")
        with self._rlock:
            r = self._r
            r["misses"] += 1
            if status == "corrupt":
                r["corrupt_pages"] += 1
        if status == "corrupt":
            self._writer.warn("corrupt page %s dropped", key.hex())
            self._queue.drop(key, None if fields is None else fields[2])
        return False

    def get_many_async(self, salt: bytes, keys: Sequence[bytes], outs: Sequence[object]) -> Future[list[bool]]:
        """``get_into`` for each (key, out) on the reader pool; the future's
        result is the list of hits. Wrap it with ``asyncio.wrap_future``."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        fmt.check_key("salt", salt)
        for k in keys:
            fmt.check_key("key", k)
        result: Future[list[bool]] = Future()
        hits: list[bool] = [False] * len(keys)
        if not keys:
            result.set_result(hits)
            return result
        n_parts = min(self.config.readers, len(keys))
        bounds = [len(keys) * i // n_parts for i in range(n_parts + 1)]
        pending = [n_parts]
        lock = threading.Lock()

        def read(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                hits[i] = self.get_into(salt, keys[i], outs[i])

        def part_done(f: Future) -> None:
            exc = f.exception()
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if exc is not None and not result.done():
                try:
                    result.set_exception(exc)
                except Exception:  # lost a race with another failing part
                    pass
            elif last and not result.done():
                result.set_result(hits)

        for lo, hi in zip(bounds, bounds[1:]):
            self._readers.submit(read, lo, hi).add_done_callback(part_done)
        return result

    def iter_meta(self, chunk: int = 65536) -> Iterator[DiskRecord]:
        """Every page's metadata, in key order, `chunk` records per short read transaction;
        skips malformed ones (scan.py)."""
        return disk_scan.iter_meta(self._env, self._meta, chunk)

    def scan_meta(self) -> disk_scan.MetaScan:
        """Every page's metadata as arrays, for the index rebuild at startup: the verification
        child's when nothing was committed since it read (disk_env.take_scan), else read now
        (scan.py)."""
        handed = disk_env.take_scan(self.path, self._env.info()["last_txnid"])
        if handed is not None:
            return handed
        return disk_scan.scan(self._env, self._meta, fmt.DB_META, self.num_pages)

    # ---------------------------------------------------------------------- stats

    def stats(self) -> dict:
        w = self._writer
        q = self._queue.stats()
        with self._rlock:
            r = dict(self._r)
        r["gets"] = r["hits"] + r["misses"]
        return dict(used_bytes=w.used_bytes, capacity_bytes=self.capacity_bytes,
                    num_pages=w.num_pages, map_size=self.map_size, map_bytes=w.budget.map_bytes,
                    map_budget=w.budget.budget, durability=self.durability,
                    last_write_time=w.last_write_time, **q, **r, **w.write_counters(), **w.health())

    @property
    def writable(self) -> bool:
        """False from a write fault until a commit succeeds again (puts are refused meanwhile)."""
        return bool(self._writer.health()["writable"])

    def reader_health(self) -> dict:
        """LMDB reader slots and map use, for `hicache doctor`. Runs ``reader_check``,
        which only frees slots left by dead processes (LMDB's own maintenance)."""
        if self._closed:
            raise DiskTierError(f"{self.path}: disk tier is closed")
        stale = self._env.reader_check()
        info = self._env.info()
        page = self._env.stat()["psize"]
        return dict(stale_readers_cleared=stale, num_readers=info["num_readers"],
                    max_readers=info["max_readers"], map_used_bytes=(info["last_pgno"] + 1) * page)

    @property
    def used_bytes(self) -> int:
        return self._writer.used_bytes

    @property
    def map_budget(self) -> int:
        """The map bytes stored pages may take in steady state (see budget.py)."""
        return self._writer.budget.budget

    @property
    def num_pages(self) -> int:
        return self._writer.num_pages
