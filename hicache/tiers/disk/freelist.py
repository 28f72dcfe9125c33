"""The free pages of the disk tier's LMDB map by contiguous run, for the writer's map
budget (budget.py).

Why: LMDB stores a value over ~2 KiB in overflow pages it must find contiguous (a
64 KiB page takes 17). A free page in a shorter run can only take B-tree pages and
small records. Transactions of one or two puts each (how a loaded machine batches
the queue) cut the runs that evictions free: each transaction's B-tree page copies
take the lowest free pages, often inside such a run. In the map budget test
(tests/tiers/test_disk_map_budget.py, 64 KiB pages, 24 MiB map), after a stretch of
one-put transactions 550 of the 1100 free pages were in runs of under 17 when a
batch of 21 pages met MDB_MAP_FULL with room for all of them by the pages' count:
more than the 1/16 of the map (384 pages) the writer kept for fragmentation. So the
writer measures, after each commit, the free pages in runs too short for its largest
value and keeps them out of its budget like pages in use.

How: py-lmdb does not expose LMDB's free list (database 0: a record per transaction,
the page numbers it freed). ``FreeList`` reads it with LMDB's own cursor functions,
which py-lmdb's extension exports, on the ``MDB_txn *`` of a read transaction
(located as native.py does). Only the records the next write transaction may
reuse count (those of transactions before the snapshot's). Where the binding is not
the one ``disk_native.locate_txn`` knows, ``open_free_list`` is None and the writer
keeps the fixed reserve alone (doubled after an MDB_MAP_FULL).
"""

from __future__ import annotations

import ctypes
import logging

import lmdb
import numpy as np

from hicache.tiers.disk import native as disk_native

log = logging.getLogger(__name__)

_FREE_DBI = 0
_MDB_FIRST, _MDB_NEXT, _MDB_NOTFOUND = 0, 8, -30798


class _Val(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("data", ctypes.c_void_p)]  # MDB_val


class FreeList:
    """Reads the free list of environments of one py-lmdb build."""

    def __init__(self, lmdb_lib: ctypes.CDLL, engine: str, txn_offset: int) -> None:
        self._txn_offset = txn_offset
        self._open = getattr(lmdb_lib, f"mdb{engine}_cursor_open")
        self._open.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
        self._get = getattr(lmdb_lib, f"mdb{engine}_cursor_get")
        self._get.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Val), ctypes.POINTER(_Val), ctypes.c_int]
        self._close = getattr(lmdb_lib, f"mdb{engine}_cursor_close")
        self._close.argtypes = [ctypes.c_void_p]
        self._close.restype = None

    def pages(self, txn: lmdb.Transaction) -> np.ndarray:
        """The page numbers (sorted) that a write transaction after `txn`'s snapshot may
        reuse: those freed by transactions before it."""
        ptr = ctypes.c_void_p.from_address(id(txn) + self._txn_offset).value
        if not ptr:
            raise lmdb.Error("the transaction is not open")
        cur = ctypes.c_void_p()
        if rc := self._open(ptr, _FREE_DBI, ctypes.byref(cur)):
            raise lmdb.Error(f"mdb_cursor_open of the free list: {rc}")
        k, d = _Val(), _Val()
        below, op, parts = txn.id(), _MDB_FIRST, []
        try:
            while (rc := self._get(cur, ctypes.byref(k), ctypes.byref(d), op)) == 0:
                op = _MDB_NEXT
                if k.size != 8 or ctypes.c_size_t.from_address(k.data).value >= below:
                    break  # keys are transaction ids in order: the rest is not reusable yet
                # the record: [n, pgno * n] as size_t
                rec = np.frombuffer(ctypes.string_at(d.data, d.size), dtype=np.uint64)
                parts.append(rec[1:1 + int(rec[0])])
        finally:
            self._close(cur)
        if rc not in (0, _MDB_NOTFOUND):
            raise lmdb.Error(f"mdb_cursor_get of the free list: {rc}")
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, np.uint64)

    def fragment_pages(self, txn: lmdb.Transaction, run_pages: int) -> int:
        """Reusable free pages in runs shorter than `run_pages` contiguous pages."""
        pages = self.pages(txn)
        if run_pages < 2 or not len(pages):
            return 0
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1  # where a run starts
        lengths = np.diff(np.concatenate(([0], breaks, [len(pages)])))
        return int(lengths[lengths < run_pages].sum())


def open_free_list(env: lmdb.Environment) -> FreeList | None:
    """A reader of `env`'s free list, or None (logged) where this py-lmdb is not the
    binding native.py knows."""
    try:
        import lmdb.cpython as lmdb_ext
        lmdb_lib = ctypes.CDLL(lmdb_ext.__file__)  # already loaded: the same handle
        with env.begin() as txn:
            engine, offset = disk_native.locate_txn(lmdb_lib, txn, lmdb_ext)
        return FreeList(lmdb_lib, engine, offset)
    except (ImportError, AttributeError, OSError, LookupError) as e:
        log.warning("the LMDB free list is unreadable here (%s): the disk map keeps a fixed reserve only", e)
        return None
