"""What the disk writer (hicache/tiers/disk/writer.py) does inside its open write
transaction: a put, a run of puts through the C loop, a deletion, a drop, and the
evict hook's call.

A put checks, in order: its parent is on disk or earlier in this transaction
(parents first), the same record is not there already (a dedup), and it fits both
budgets (page bytes, and the map: budget.py), asking the evict hook for room once
per batch; it then writes its meta record and its page. The C loop (native.py)
does the same for a run of puts and batch parts and hands anything else back to
``_put``. Every method works on the transaction's running totals (the writer's
``*_tx`` attributes), which the writer makes shared only after the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import lmdb

from hicache.tiers.disk import format as fmt
from hicache.tiers.disk import native as disk_native
from hicache.tiers.disk.batch import BatchPart
from hicache.tiers.disk.ops import PutOp

if TYPE_CHECKING:
    from hicache.tiers.disk.budget import MapBudget

log = logging.getLogger(__name__)


class TxnOps:
    """Mixed into DiskWriter (hicache/tiers/disk/writer.py), which owns the state below."""

    if TYPE_CHECKING:  # DiskWriter's
        capacity_bytes: int
        evict_hook: Callable[[int], Iterable[bytes]] | None  # writer.py's EvictHook
        budget: MapBudget
        _pages: object
        _meta: object
        _psize: int
        _used_bytes_tx: int
        _map_bytes_tx: int
        _deleted_tx: int
        _num_pages_tx: int
        _headroom_tx: int
        _now_tx: float
        _may_defer: bool
        _put_in_tx: set[bytes]
        _doomed: dict[bytes, bool]
        _native: disk_native.NativePutLoop | None
        _native_dbis: tuple[int, int]
        _native_state: disk_native.State

    def _put(self, txn: lmdb.Transaction, p: PutOp, remaining: int, hook_dry: bool,
             c: dict[str, int]) -> tuple[bool | None, bool]:
        """One put inside the writer's transaction; (accepted, hook_dry), accepted None:
        it fits only once pages freed by recent commits are reusable (writer.py's docstring)."""
        size = p.page.nbytes
        if (p.parent_required and p.parent is not None and p.parent not in self._put_in_tx
                and txn.get(p.parent, db=self._meta) is None):
            c["rejected_orphan"] += 1  # its parent never reached disk, or left it: never acknowledged
            return False, hook_dry
        old = txn.get(p.key, db=self._meta)
        if old is not None:
            hdr = fmt.unpack_meta_header(old)
            if hdr is not None and hdr.salt == p.salt and hdr.size == size:
                c["dedup_puts"] += 1  # same key, same namespace: same content
                return True, hook_dry
            self._delete(txn, p.key)
        charge = p.charge or fmt.footprint(size, len(p.tokens) // 4, self._psize)
        b = self.budget
        if charge > b.max_footprint:
            b.max_footprint = charge
        headroom = self._headroom_tx
        map_budget = b.budget_under(headroom)
        # footprint >= size: asking for the map's excess in page bytes frees at least that much
        over = max(self._used_bytes_tx + size - self.capacity_bytes,
                   self._map_bytes_tx - self._deleted_tx + charge - map_budget)
        if over > 0 and not hook_dry:
            # ask once for the rest of the batch too: one hook call per batch, typically
            keys = self._call_hook(over + remaining)
            hook_dry = not keys
            for k in keys:
                c["evicted_pages"] += self._delete(txn, k)
        if self._used_bytes_tx + size > self.capacity_bytes or \
                self._map_bytes_tx - self._deleted_tx + charge + headroom > b.map_size:
            c["rejected_budget"] += 1
            return False, hook_dry
        if self._map_bytes_tx + sum(b.freed) + charge + headroom > b.map_size and self._may_defer:
            return None, hook_dry  # the pages deleted here or just before are not reusable yet
        if p.job is not None:
            txn.put(p.key, p.page, db=self._pages)  # the hasher works on this or later pages meanwhile
        if p.digest is None:
            p.digest = p.job.digest(p) if p.job is not None else fmt.checksum(p.page)
        # Meta record first, as the C loop writes: the same allocations, so the same free
        # list (the map budget reads it) whichever loop wrote a page.
        txn.put(p.key, fmt.pack_meta(p.parent, p.salt, size, p.digest, self._now_tx, fmt.CHECKSUM_XXH3,
                                     p.tokens), db=self._meta)
        if p.job is None:
            txn.put(p.key, p.page, db=self._pages)
        self._used_bytes_tx += size
        self._map_bytes_tx += charge
        self._num_pages_tx += 1
        self._put_in_tx.add(p.key)  # a child later in the batch needs no lookup of it
        c["pages_written"] += 1
        c["bytes_written"] += size
        return True, hook_dry

    def _put_native(self, txn: lmdb.Transaction, ops: list, lo: int, remaining: int,
                    c: dict[str, int], results: list) -> tuple[int, int]:
        """Puts the run of ops from ops[lo] that the C loop takes (native.py), on the
        transaction's running totals; (the index it stopped at, bytes of puts left). The op
        there goes through the Python path (a deletion, a big page, or one handed back: of
        a batch part stopped at page j, ops[index] becomes the part from j on); an LMDB
        error is raised as py-lmdb raises it."""
        st = self._native_state
        st.used_bytes, st.map_bytes, st.deleted_bytes = self._used_bytes_tx, self._map_bytes_tx, self._deleted_tx
        st.capacity_bytes, st.map_size, st.headroom = self.capacity_bytes, self.budget.map_size, self._headroom_tx
        st.batch_limit, st.max_footprint = self.budget.batch_limit, self.budget.max_footprint
        st.freed_bytes, st.may_defer, st.now = sum(self.budget.freed), self._may_defer, self._now_tx
        st.pages_written = st.bytes_written = st.dedup_puts = st.rejected_orphan = st.put_bytes_done = 0
        codes = self._native.run(txn, *self._native_dbis, ops, lo, PutOp, BatchPart, st)
        self._used_bytes_tx, self._map_bytes_tx = st.used_bytes, st.map_bytes
        self.budget.max_footprint = st.max_footprint
        self._num_pages_tx += st.pages_written
        c["pages_written"] += st.pages_written
        c["bytes_written"] += st.bytes_written
        c["dedup_puts"] += st.dedup_puts
        c["rejected_orphan"] += st.rejected_orphan
        if st.stop_why == disk_native.STOP_ERROR:
            raise self._native.error(st.stop_rc)
        stop = st.stop_index
        pos = 0  # the outcomes in `codes`, a page each, in op order
        for op in ops[lo:stop]:
            if type(op) is PutOp:
                results.append((op, codes[pos] != disk_native.ORPHAN))
                pos += 1
            else:
                op.batch.results[op.lo:op.hi] = codes[pos:pos + op.hi - op.lo]
                results.append((op, None))
                pos += op.hi - op.lo
        if st.stop_page > 0 and type(ops[stop]) is BatchPart and ops[stop].lo < st.stop_page:
            part, j = ops[stop], st.stop_page  # stopped inside a part: its pages before j are done
            part.batch.results[part.lo:j] = codes[pos:pos + j - part.lo]
            results.append((BatchPart(part.batch, part.lo, j), None))
            ops[stop] = BatchPart(part.batch, j, part.hi)
        return stop, remaining - st.put_bytes_done

    def _drop(self, txn: lmdb.Transaction, key: bytes, checksum: tuple[int, int] | None) -> None:
        cur = txn.get(key, db=self._meta)
        hdr = None if cur is None else fmt.unpack_meta_header(cur)
        if cur is None or (hdr.checksum if hdr is not None else None) == checksum:
            self._delete(txn, key)  # not rewritten since the reader saw it

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Delete one entry inside the writer's transaction; the pages freed (0 or 1)."""
        self._put_in_tx.discard(key)
        page = txn.get(key, db=self._pages)
        meta = txn.get(key, db=self._meta)
        had_meta = txn.delete(key, db=self._meta)
        if page is None:
            return int(had_meta)  # a page-less record (corruption): no bytes to account
        self._used_bytes_tx -= len(page)
        n_tokens = (len(meta) - fmt.META_HEADER_BYTES) // 4 if meta is not None else 0
        self._deleted_tx += fmt.footprint(len(page), n_tokens, self._psize)
        self._num_pages_tx -= 1
        txn.delete(key, db=self._pages)
        return 1

    def _call_hook(self, bytes_needed: int) -> list[bytes]:
        if self.evict_hook is None:
            return []
        try:
            keys = [k for k in self.evict_hook(bytes_needed) if isinstance(k, bytes)]
        except Exception:
            log.exception("disk tier evict_hook failed")
            return []
        self._doomed.update(dict.fromkeys(keys, True))  # doomed even if this transaction aborts
        return keys
