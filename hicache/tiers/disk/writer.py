"""The disk tier's writer: the one thread that runs every LMDB write
transaction of hicache/tiers/disk/tier.py, and the budget.

- One thread, because LMDB write transactions are thread-bound and exclusive.
  Callers only append to a bounded in-memory queue (queue.py), so a put
  never waits for the disk. The writer drains up to ``batch_pages``/``batch_bytes``
  per transaction, in queue order (a put then a delete of one key ends deleted).
  A batch of ``put_many_async`` is one queue item and one answer (batch.py);
  the writer splits it where a transaction ends or a page needs the Python path.
- No copies: a put hands the caller's buffer straight to LMDB (see DiskTier's
  contract on keeping it unchanged). The XXH3 checksum of a page under 1 MiB
  runs inline on this thread, next to LMDB's copy while the page is in the
  cache; pages of 1 MiB and more are hashed on a hasher thread (xxhash drops the
  GIL), one job per batch, while this thread copies earlier pages into the map.
  (A hasher in C for batches of 16-256 KiB pages, racing the writer page by page,
  cut the writer's CPU per page by ~10% but not the wall time in an A/B: the
  writer's copy then reads a source no hash has warmed.)
  Measured on this 2-vCPU VM with nothing else running, puts / raw py-lmdb:
  inline everywhere 0.71-0.80 at 1-2 MiB; with the hasher 0.9 there (256 KiB
  pages lose more to the hand-off than they gain, so they stay inline).
- Runs of puts and batch parts go through a C loop where one can be built
  (native.py): one call per run, the GIL released throughout, LMDB called
  from C. It takes the common case (parent check, budget check, XXH3, meta
  record, page) and
  hands anything else back to ``_put`` (a key rewritten under another
  namespace or size, a put the evict hook must make room for or that has to
  wait for freed pages); pages of 1 MiB and more, hashed on the hasher thread,
  stay on the Python loop. The Python loop is the fallback and does the same.
- Two budgets: ``capacity_bytes`` of page bytes, and the map (budget.py:
  each put is charged its footprint in the map, and a put goes in only when
  the map holds it and the headroom LMDB's copy-on-write and free-page reuse
  need, at once). A put that would fit once the freed pages are reusable ends
  the transaction early; two empty commits later the rest of the batch goes
  on. Otherwise it is over budget (rejected, counted), never an MDB_MAP_FULL.
- The tier never picks victims. When a put does not fit a budget,
  the writer asks ``evict_hook(bytes_needed)`` for keys (the radix index knows
  LRU leaf order) and deletes them in the same transaction; keys the hook
  returns are as good as deleted (a failed transaction retries them). With no
  hook, or too little freed, the put is rejected (``on_done(key, False)``,
  counted).
- Parents first: a put whose ``parent_required`` parent has no record on disk
  (not committed earlier, nor earlier in this transaction) is rejected
  (``rejected_orphan``), so no committed page is ever unreachable from its
  namespace, whatever happened to the writes before it.
- ``MapFullError`` or any other LMDB error aborts the batch; the writer then
  evicts through the hook, commits twice so the freed pages become reusable
  (LMDB reuses a page freed by transaction T only from T+2 on), retries the
  batch once and otherwise commits it op by op: what fits goes in, the rest is
  rejected. The writer thread never dies and never stalls.
- A fault: when not even one op of a batch commits on its own, for a reason
  other than the budget (an I/O error, a damaged B-tree, a read-only file),
  writes are disabled for ``write_retry_s``: puts return False (counted as
  ``skipped_disabled``), queued ones are rejected without touching the disk,
  reads go on. The next batch after that retries; one commit ends the fault.
  Logged once per fault, counted in ``write_faults``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import lmdb

from hicache.errors import DiskTierError
from hicache.tiers.disk import format as fmt
from hicache.tiers.disk import native as disk_native
from hicache.tiers.disk.batch import BatchPart, expand_all, put_bytes
from hicache.tiers.disk.budget import MapBudget
from hicache.tiers.disk.config import DiskTierConfig
from hicache.tiers.disk.ops import (HASH_OFFLOAD_BYTES, BarrierOp, DeleteOp, DropOp, HashJob, PutOp,
                                    native_ok)
from hicache.tiers.disk.queue import WriteQueue
from hicache.tiers.disk.recovery import WriteRecovery
from hicache.tiers.disk.txn_ops import TxnOps

log = logging.getLogger(__name__)

EvictHook = Callable[[int], Iterable[bytes]]


class DiskWriter(TxnOps, WriteRecovery):
    """The writer thread and its queue; started on construction. ``DiskTier``
    validates arguments and owns the environment; this class owns its writes
    (the ops inside a transaction: txn_ops.py; after a failed one: recovery.py).
    ``used_bytes``, ``num_pages`` and ``last_write_time`` change only on the
    writer thread (others read them for stats)."""

    def __init__(self, env: lmdb.Environment, path: str, *, pages: object, meta: object, info: object,
                 capacity_bytes: int, map_size: int, config: DiskTierConfig,
                 evict_hook: EvictHook | None, used_bytes: int, num_pages: int) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.config = config
        self.evict_hook = evict_hook  # the owner may replace it at any time
        self._env = env
        self._pages, self._meta, self._info = pages, meta, info
        # Writer-owned state (read elsewhere only for stats).
        self.used_bytes = used_bytes
        self.num_pages = num_pages
        self._used_bytes_tx = used_bytes  # running totals inside the open write transaction
        self._put_in_tx: set[bytes] = set()  # keys put by the open transaction and not deleted since
        self._num_pages_tx = num_pages
        self._native = disk_native.loop(env) if config.native_writer else None
        if self._native is not None:
            with env.begin() as txn:
                self._native_dbis = (self._native.dbi(txn, fmt.DB_PAGES), self._native.dbi(txn, fmt.DB_META))
        self._native_state = disk_native.State()
        # The main database is counted too: it holds the other databases' records.
        self.budget = MapBudget(env, (env.open_db(None), pages, meta, info), map_size,
                                batch_pages=config.batch_pages, batch_bytes=config.batch_bytes)
        self._psize = self.budget.psize
        self._map_bytes_tx = self.budget.map_bytes
        self._deleted_tx = 0  # footprint deleted by the open transaction: reusable two commits on
        self._headroom_tx = 0  # set by each _commit
        self._now_tx = 0.0
        self._deferred: list = []  # ops left for after the freed pages are reusable
        self._may_defer = True
        self._doomed: dict[bytes, bool] = {}  # key -> evicted?; kept until a commit succeeds
        self._drops: dict[bytes, tuple[int, int] | None] = {}
        self._w = dict(pages_written=0, bytes_written=0, dedup_puts=0, rejected_budget=0,
                       rejected_errors=0, rejected_orphan=0, write_errors=0, evicted_pages=0,
                       deleted_pages=0, batches=0, deferred_batches=0)
        # The fault state (see the module docstring); written on the writer thread.
        self._fault = ""
        self._faults = 0
        self._op_fault: BaseException | None = None
        self.last_write_time = 0.0
        self._last_warning = -1e9
        self._suppressed = 0
        self._last_touch_flush = time.monotonic()
        self.queue = WriteQueue(config, self._psize)  # what callers append to (queue.py)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hicache-disk-hash")
        self._thread = threading.Thread(target=self._main, name="hicache-disk-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- any thread

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until everything queued so far is committed; False on timeout."""
        done = threading.Event()
        if not self.queue.enqueue(BarrierOp(done)):
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
            if not self._thread.is_alive():
                raise DiskTierError(f"{self.path}: the disk tier's writer thread is gone")
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def stop(self) -> bool:
        """Drain the queue, commit and end the thread. Every caller waits for the
        thread; only the first gets True."""
        first = self.queue.close()
        self._thread.join()
        if first:
            self._hasher.shutdown(wait=True)
        return first

    def write_counters(self) -> dict:
        return dict(self._w)

    def health(self) -> dict:
        """``writable`` is False from a fault until a commit succeeds again."""
        return dict(writable=not self._fault, write_fault=self._fault, write_faults=self._faults)

    def warn(self, msg: str, *args: object) -> None:
        """A warning at most every 10 s (any thread; races only blur the count):
        a full map fails every batch until space is freed."""
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            log.warning("disk tier %s: " + msg + " (%d similar warnings suppressed)", self.path, *args,
                        self._suppressed)
            self._last_warning, self._suppressed = now, 0
        else:
            self._suppressed += 1

    # ------------------------------------------------------------ the writer thread

    def _main(self) -> None:
        while True:
            try:
                ops, stop = self.queue.take(self.budget.batch_ops, self.budget.batch_limit)
                if ops or self._touch_due(stop):
                    self._run_batch(ops, stop or any(isinstance(o, BarrierOp) for o in ops))
            except Exception:  # a bug; the writer must outlive it
                log.exception("disk tier %s: writer loop error", self.path)
                time.sleep(0.1)
                continue
            if stop:
                return

    def _touch_due(self, force: bool) -> bool:
        if not self.queue.touches:
            return False
        return force or time.monotonic() - self._last_touch_flush >= self.config.touch_interval_s

    def _run_batch(self, ops: list, force_touch: bool) -> None:
        results = None
        try:
            if self._fault and time.monotonic() < self.queue.refuse_until:
                results = self._refuse(ops)
            else:
                results = self._write(ops, force_touch)
        except Exception:  # a bug: reject the batch but never let the writer thread die
            log.exception("disk tier %s: write batch failed", self.path)
        finally:
            if results is None:
                results = [(op, False) for op in ops if isinstance(op, PutOp)]
                for op in ops:
                    if type(op) is BatchPart:
                        op.reject()
                        results.append((op, None))
            for p, ok in results:
                if ok is None:  # a batch's pages [lo, hi): their outcomes are in the batch
                    p.batch.answered(p.hi - p.lo)
                elif p.on_done is not None:
                    try:
                        p.on_done(p.key, ok)
                    except Exception:
                        log.exception("disk tier on_done callback failed")
            if ops and type(ops[-1]) is BarrierOp:  # only ever last (WriteQueue.take)
                ops[-1].done.set()

    def _write(self, ops: list, force_touch: bool) -> list[tuple[PutOp | BatchPart, bool | None]]:
        if self._native is None or any(type(op) is BatchPart and op.batch.page_bytes >= HASH_OFFLOAD_BYTES
                                       for op in ops):
            ops = expand_all(ops)  # page by page: the Python loop, or big pages for the hasher
        big = [op for op in ops if isinstance(op, PutOp) and op.digest is None and op.job is None
               and op.page.nbytes >= HASH_OFFLOAD_BYTES]
        if big:
            job = HashJob(big)
            for op in big:
                op.job = job
            self._hasher.submit(job.run)
        try:
            return self._commit(ops, force_touch)
        except lmdb.Error as e:  # MapFullError, or an I/O error from LMDB
            self._w["write_errors"] += 1
            if isinstance(e, lmdb.MapFullError):
                self.budget.widen(self.path)
            self.warn("write failed (%s); evicting and retrying", e)
            self._make_room(put_bytes(ops))
            try:
                return self._commit(ops, force_touch)
            except lmdb.Error:
                pass
        except Exception:
            log.exception("disk tier %s: write batch failed; retrying op by op", self.path)
        return self._commit_op_by_op(ops, force_touch)  # recovery.py

    def _commit(self, ops: list, force_touch: bool) -> list[tuple[PutOp, bool]]:
        """Apply leftover deletions, then `ops` in order, then due touches, in
        ONE write transaction. Shared state changes only after the commit."""
        self._used_bytes_tx, self._num_pages_tx = self.used_bytes, self.num_pages
        self._map_bytes_tx = self.budget.map_bytes
        self._deleted_tx = 0
        self._put_in_tx.clear()
        # Constant for the transaction: the headroom's inputs change only at a commit (and the
        # map budget with the largest footprint seen, which _put updates), one clock reading.
        self._headroom_tx = self.budget.headroom()
        self._now_tx = time.time()
        c = dict(evicted_pages=0, deleted_pages=0, pages_written=0, bytes_written=0, dedup_puts=0,
                 rejected_budget=0, rejected_orphan=0)
        results: list[tuple[PutOp, bool]] = []
        touches = None
        with self._env.begin(write=True, buffers=True) as txn:
            for k, evicted in list(self._doomed.items()):
                c["evicted_pages" if evicted else "deleted_pages"] += self._delete(txn, k)
            for k, checksum in self._drops.items():
                self._drop(txn, k, checksum)
            remaining = put_bytes(ops)
            hook_dry = False
            work = list(ops)  # a batch part handed back is split here; `ops` stays as it came for a retry
            i = 0
            while i < len(work):
                op = work[i]
                if self._native is not None and (type(op) is BatchPart or native_ok(op)):
                    i, remaining = self._put_native(txn, work, i, remaining, c, results)
                    if i == len(work):
                        break
                    op = work[i]  # the op after the run, or one handed back: the Python path below
                if type(op) is BatchPart:  # its first page handed back: that page alone in Python
                    work[i:i + 1] = [op.batch.page_op(op.lo)] + ([BatchPart(op.batch, op.lo + 1, op.hi)]
                                                                 if op.hi > op.lo + 1 else [])
                    op = work[i]
                if isinstance(op, DeleteOp):
                    for k in op.keys:
                        c["deleted_pages"] += self._delete(txn, k)
                elif isinstance(op, DropOp):
                    self._drop(txn, op.key, op.checksum)
                elif isinstance(op, PutOp):
                    remaining -= op.page.nbytes
                    ok, hook_dry = self._put(txn, op, remaining, hook_dry, c)
                    if ok is None:  # fits once the freed pages are reusable: after this commit
                        self._deferred = work[i:]
                        break
                    results.append((op, ok))
                i += 1
            if self.queue.touches and (force_touch or self._touch_due(False)):
                touches = self.queue.take_touches()
                for k, t in touches.items():
                    cur = txn.get(k, db=self._meta)
                    if cur is not None:
                        txn.put(k, fmt.with_last_access(bytes(cur), t), db=self._meta)
            txn.put(fmt.INFO_TOTALS_KEY, fmt.pack_totals(self._used_bytes_tx, self._num_pages_tx),
                    db=self._info)
            measured = self.budget.measure(txn)
        # committed
        self.budget.committed(self._map_bytes_tx, measured, self.warn)
        if self._fault:
            log.warning("disk tier %s: writes resumed after %s", self.path, self._fault)
            self._fault = ""
            self.queue.refuse_until = 0.0
        if touches is not None:
            self._last_touch_flush = time.monotonic()
        self._doomed.clear()
        self._drops.clear()
        self.used_bytes, self.num_pages = self._used_bytes_tx, self._num_pages_tx
        for name, n in c.items():
            self._w[name] += n
        self._w["batches"] += 1
        self.last_write_time = time.time()
        if self._deferred:
            rest, self._deferred = self._deferred, []
            self._w["deferred_batches"] += 1
            self._commit([], False)  # T+1
            self._commit([], False)  # T+2: the pages T freed are reusable
            self._may_defer = False  # once: what does not fit now is over budget
            try:
                results += self._commit(rest, force_touch)
            finally:
                self._may_defer = True
        return results
