"""Batched puts for the disk tier (``DiskTier.put_many_async``): a run of pages queued
as ONE item and answered by ONE callback, so that neither the producer (the daemon's
event loop) nor the writer thread runs Python per page.

Why: with the C put loop (native.py) writing the pages, what was left per 16 KiB
page was Python: ~3 us of ``put_async`` on the producer's thread and ~2 us on the
writer (taking the op, its result, ``on_done``), both holding the GIL
(docs/benchmarks.md, "Disk tier"). A batch carries its keys, tokens and page rows as
arrays; the C loop reads each page's fields straight from them.

- ``PutBatch`` is what the caller queued: the keys (16 bytes each, concatenated), the
  first page's parent (page i > 0 has page i - 1 as parent when ``chained``), the
  tokens (the same count per page), the pages as rows of one buffer (``store``, rows
  of ``page_bytes``, page i at row ``rows[i]``: an arena's slots without a view per
  page), one ``on_done(oks)`` for the whole batch.
- ``BatchPart`` (batch, lo, hi) is the queue item and the writer's op: the writer
  splits a batch where a transaction ends (``batch_ops`` / ``batch_bytes``), where the
  C loop hands a page back (the evict hook, a key rewritten, a wait for freed pages)
  and where a failed batch is retried op by op; such pages go through the Python path
  as ordinary ``PutOp``s (``page_op``), whose outcome lands in the same batch.
- Each page's outcome is kept in ``results`` (disk_native's codes: WRITTEN, DEDUP,
  ORPHAN; 0 rejected) until the batch's last page is answered; ``on_done`` then gets
  one bool per page, on the writer thread, after the commit (as ``put_async``'s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hicache.tiers.disk import format as fmt
from hicache.tiers.disk.ops import PutOp

log = logging.getLogger(__name__)

BatchDone = Callable[[list[bool]], None]

# results code -> ok: WRITTEN (1) and DEDUP (2) are stored pages; NOT_DONE (0) and ORPHAN (3) are not
_OK = bytes([0, 1, 1, 0]) + bytes(252)


@dataclass(slots=True, eq=False)
class PutBatch:
    """One ``put_many_async`` call, validated (see the module docstring)."""

    salt: bytes
    keys: bytes  # 16 bytes per page
    parent: bytes | None  # the first page's parent
    chained: bool  # page i > 0 hangs under page i - 1 (else under `parent` too)
    tokens: bytes  # little-endian int32, `token_bytes` per page
    token_bytes: int
    store: memoryview  # flat bytes: rows of `page_bytes`
    page_bytes: int
    rows: memoryview  # int64 row of each page in `store`
    on_done: BatchDone | None
    parent_required: bool
    n_pages: int
    charge: int = 0  # each page's footprint in the map (disk_format.footprint), set by the writer
    results: bytearray | None = None
    pending: int = 0  # pages not answered yet

    def key(self, i: int) -> bytes:
        return self.keys[16 * i:16 * i + 16]

    def page(self, i: int) -> memoryview:
        off = self.rows[i] * self.page_bytes
        return self.store[off:off + self.page_bytes]

    def page_op(self, i: int) -> PutOp:
        """Page i as an ordinary put for the writer's Python path; its outcome comes back here."""
        parent = self.key(i - 1) if self.chained and i else self.parent
        op = PutOp(self.salt, self.key(i), parent, self.tokens[i * self.token_bytes:(i + 1) * self.token_bytes],
                   self.page(i), lambda _key, ok: self.answer(i, ok), self.parent_required)
        op.charge = self.charge
        return op

    def answer(self, i: int, ok: bool) -> None:
        self.results[i] = 1 if ok else 0
        self.answered(1)

    def answered(self, n: int) -> None:
        """`n` more pages answered (their codes are in ``results``); the last call reports."""
        self.pending -= n
        if self.pending or self.on_done is None:
            return
        try:
            self.on_done(list(map(bool, self.results.translate(_OK))))
        except Exception:
            log.exception("disk tier on_done callback failed")


def make_batch(salt: bytes, keys: Sequence[bytes], parent_key: bytes | None, tokens: object, pages: object,
               on_done: BatchDone | None, rows: object, chained: bool, parent_required: bool) -> PutBatch:
    """``DiskTier.put_many_async``'s arguments checked (ValueError, nothing queued) and
    turned into a batch: keys joined, tokens as int32 bytes, the rows copied."""
    fmt.check_key("salt", salt)
    if parent_key is not None:
        fmt.check_key("parent_key", parent_key)
    blob = getattr(keys, "blob", None)  # a radix node's keys, packed (hicache/index/keys.py's KeyRun)
    if type(blob) is bytes and len(blob) % fmt.KEY_BYTES == 0:
        n = len(blob) // fmt.KEY_BYTES
    else:
        n, blob = len(keys), None
        if set(map(type, keys)) != {bytes} or set(map(len, keys)) != {fmt.KEY_BYTES}:
            for k in keys:
                fmt.check_key("key", k)
    if n == 0:
        raise ValueError("keys is empty")
    try:
        mv = memoryview(pages)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"pages must be a 2-D buffer of rows, got {type(pages).__name__}") from e
    if mv.ndim != 2 or not mv.c_contiguous or mv.nbytes == 0:
        raise ValueError(f"pages must be a non-empty C-contiguous 2-D buffer, got {mv.ndim} dimensions")
    n_rows, page_bytes = mv.shape[0], mv.nbytes // mv.shape[0]
    row = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows)
    if row.shape != (n,) or row.dtype.kind not in "iu":
        raise ValueError(f"rows must be {n} integers, one per key")
    # a node's few rows: Python's min and max over a list cost a third of numpy's reductions
    low, high = (min(r := row.tolist()), max(r)) if n <= 256 else (row.min(), row.max())
    if rows is None and n_rows < n or low < 0 or high >= n_rows:
        raise ValueError(f"pages has {n_rows} rows: a page is out of range")
    tok = np.asarray(tokens)
    if tok.ndim not in (1, 2) or tok.dtype.kind not in "iu" or tok.size % n or \
            tok.ndim == 2 and tok.shape[0] != n:
        raise ValueError(f"tokens must be integers, the same number for each of the {n} pages")
    return PutBatch(salt, blob if blob is not None else b"".join(keys), parent_key, chained, tok.astype("<i4", copy=False).tobytes(),
                     4 * (tok.size // n), mv.cast("B"), page_bytes,
                     memoryview(np.array(row, dtype=np.int64)), on_done, parent_required, n)


@dataclass(slots=True, eq=False)
class BatchPart:
    """Pages [lo, hi) of a batch: a queue item, and an op of a write transaction."""

    batch: PutBatch
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.batch.page_bytes

    def expand(self) -> list[PutOp]:
        return [self.batch.page_op(i) for i in range(self.lo, self.hi)]

    def reject(self) -> None:
        """Record its pages as not written (they are answered when the caller reports the part)."""
        self.batch.results[self.lo:self.hi] = bytes(self.hi - self.lo)


def expand_all(ops: list) -> list:
    """`ops` with every batch part replaced by its pages as ``PutOp``s (for the paths
    that work op by op: the retry of a failed batch, big pages for the hasher)."""
    if not any(type(op) is BatchPart for op in ops):
        return ops
    out: list = []
    for op in ops:
        if type(op) is BatchPart:
            out += op.expand()
        else:
            out.append(op)
    return out


def put_bytes(ops: list) -> int:
    """Page bytes of the puts among `ops`."""
    return sum(op.page.nbytes if type(op) is PutOp else op.nbytes for op in ops
               if type(op) is PutOp or type(op) is BatchPart)
