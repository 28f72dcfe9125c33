"""The disk tier's map budget: how much of LMDB's fixed-size map a write
transaction may fill without ever hitting MDB_MAP_FULL (used by writer.py,
on the writer thread only).

- Each put is charged its footprint in the map (``disk_format.footprint``:
  whole overflow pages, B-tree leaves at half fill), and the pages in use are
  re-measured from LMDB's own counts at every commit, so the estimate never
  drifts.
- A put goes in only when the map holds, at once: the pages in use (those the
  transaction deletes included), the pages the last two transactions freed
  (LMDB reuses a page freed by T only from T+2 on, later if a reader is still
  on an older snapshot), the transaction's new pages, copies of the B-tree
  pages it and the last two touched, the free pages in runs too short for the
  largest value (a value of several pages needs as many contiguous free pages;
  measured from LMDB's free list after each commit, freelist.py), and a
  reserve of 1/16 of the map (for the runs the transaction cuts; after an
  MDB_MAP_FULL all the same, the reserve doubles, up to 1/4).
- A transaction puts or deletes at most ``batch_ops`` keys (a long deletion is
  split), so its copies are bounded: a deletion needs new pages too, and must
  never be what fills the map.
- ``budget`` is what owners keep the stored pages' footprint under, so that
  puts rarely wait for freed pages.
"""

from __future__ import annotations

import logging

import lmdb

from hicache.tiers.disk.freelist import open_free_list

log = logging.getLogger(__name__)


class MapBudget:
    """The map's accounting between commits. ``map_bytes`` and the fields below
    change only at a commit (``committed``), an MDB_MAP_FULL (``widen``) or when a
    larger page is charged (``max_footprint``, which the writer raises)."""

    def __init__(self, env: lmdb.Environment, dbs: tuple, map_size: int, *, batch_pages: int,
                 batch_bytes: int) -> None:
        self._env = env
        self._dbs = dbs  # every database whose pages count, the main one (their records) included
        self.map_size = map_size
        self.psize = env.stat()["psize"]
        # Batches scaled to the map: a small map cannot hold a 64 MiB batch and its frees.
        self.batch_ops = max(1, min(batch_pages, map_size // (64 * self.psize)))
        self.batch_limit = max(self.psize, min(batch_bytes, map_size // 16))
        with env.begin() as txn:
            self.map_bytes, self._tree_bytes = self.measure(txn)  # pages in use; B-tree pages of them
        self.freed = (0, 0)  # bytes freed by the last two commits, newest first
        self.frag_divisor = 16  # the map's share kept for fragmentation: 1/16, more after an MDB_MAP_FULL
        self._free_list = open_free_list(env)
        self._fragment_bytes = 0  # free pages in runs too short for the largest value, at the last commit
        self.max_footprint = 0  # the largest page charged yet: a batch may end one page past its limit

    def measure(self, txn: lmdb.Transaction) -> tuple[int, int]:
        """(bytes of the pages the databases use, bytes of their B-tree pages), from
        LMDB's counts: O(1), read from the databases' records."""
        total = tree = 0
        for db in self._dbs:
            st = txn.stat(db)
            tree += (st["branch_pages"] + st["leaf_pages"]) * self.psize
            total += (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * self.psize
        return total, tree

    def headroom(self, with_fragments: bool = True) -> int:
        """Copies of the B-tree pages a transaction touches (each put or deleted key up to
        three levels in two databases; this transaction's and the copies the last two
        replaced, not reusable yet), LMDB's meta pages and free list, the free pages in runs
        too short for the largest value, and 1/16 of the map for the runs a transaction cuts:
        a value of several pages needs that many contiguous free pages."""
        cow = min(self._tree_bytes, 6 * self.batch_ops * self.psize)
        fragments = self._fragment_bytes if with_fragments else 0
        return 3 * cow + 8 * self.psize + fragments + self.map_size // self.frag_divisor

    def budget_under(self, headroom: int) -> int:
        """The footprint stored pages may take, given a transaction's headroom: the map
        less it and the frees of the last two batches."""
        return self.map_size - headroom - 2 * (self.batch_limit + self.max_footprint)

    @property
    def budget(self) -> int:
        return self.budget_under(self.headroom())

    def committed(self, map_bytes_before: int, measured: tuple[int, int], warn) -> None:
        """After a commit: what it freed (deleted pages and replaced B-tree pages), the
        pages in use as LMDB counts them, and the free list's short runs."""
        self.freed = (max(0, map_bytes_before - measured[0]), self.freed[0])
        self.map_bytes, self._tree_bytes = measured
        self._fragment_bytes = self._fragments(warn)

    def widen(self, path: str) -> None:
        """An MDB_MAP_FULL despite the budget: the free pages were too scattered, so keep
        more of the map free from now on (1/16 → 1/8 → 1/4)."""
        if self.frag_divisor > 4:
            self.frag_divisor //= 2
            log.warning("disk tier %s: the map filled up with pages free but scattered; keeping 1/%d of it "
                        "free from now on", path, self.frag_divisor)

    def _fragments(self, warn) -> int:
        """Bytes of the reusable free pages in runs too short for the largest value
        stored yet (a footprint's pages bound its run), from the committed free list."""
        run_pages = self.max_footprint // self.psize
        if self._free_list is None or run_pages < 2:
            return 0  # no free list to read, or every value fits a page: any free page serves
        tail = self.map_size - (self._env.info()["last_pgno"] + 1) * self.psize
        if tail >= self.headroom(with_fragments=False) + self.batch_limit + self.max_footprint:
            return 0  # a whole transaction fits the map's untouched end, one run: skip the read
        try:
            with self._env.begin() as txn:
                return self._free_list.fragment_pages(txn, run_pages) * self.psize
        except lmdb.Error as e:
            warn("could not read the free list: %s", e)
            return self._fragment_bytes
