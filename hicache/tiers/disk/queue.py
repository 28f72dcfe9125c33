"""The disk writer's queue (hicache/tiers/disk/writer.py): any thread appends puts,
batches, deletions and touches; the writer thread takes a transaction's worth at a time.

- Bounded by ``max_queue_pages`` / ``max_queue_bytes``: a put that does not fit is a
  ``False`` return (a batch: only its first pages are queued), counted, never a wait.
- While writes are disabled after a fault (``refuse_until``, set by the writer) puts
  are refused and counted as ``skipped_disabled``.
- ``take`` hands the writer up to ``batch_ops`` keys / ``batch_limit`` bytes of map
  footprint, in queue order; a batch part or a deletion that does not fit is split, its
  rest stays at the head. Puts notify the writer only while it waits (a notify costs
  ~0.5 us of Python).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

from hicache.tiers.disk import format as fmt
from hicache.tiers.disk.batch import BatchPart, PutBatch
from hicache.tiers.disk.config import DiskTierConfig
from hicache.tiers.disk.ops import BarrierOp, DeleteOp, DropOp, OnDone, PutOp


class WriteQueue:
    """Guarded by ``cond``; the writer reads ``touches`` and ``closing`` under it too."""

    def __init__(self, config: DiskTierConfig, psize: int) -> None:
        self.config = config
        self._psize = psize
        self.cond = threading.Condition()
        self._ops: deque[PutOp | BatchPart | DeleteOp | DropOp | BarrierOp] = deque()
        self._queued_pages = 0
        self._queued_bytes = 0
        self._other_ops = 0  # queued deletions, drops and barriers
        self._puts = 0
        self._skipped_queue_full = 0
        self._skipped_disabled = 0
        self.touches: dict[bytes, float] = {}
        self.closing = False
        self.refuse_until = 0.0  # monotonic; the writer sets it while writes are disabled
        self._writer_waiting = False  # in take's wait: puts notify only then

    # ------------------------------------------------------------ any thread

    def put(self, salt: bytes, key: bytes, parent: bytes | None, tokens: bytes, page: memoryview,
            on_done: OnDone | None, parent_required: bool = True) -> bool:
        """Queue one (validated) page; False (counted) when full, closing or disabled."""
        op = PutOp(salt, key, parent, tokens, page, on_done, parent_required)
        with self.cond:
            if not self._admit(1, page.nbytes):
                return False
            self._push(op, 1, page.nbytes)
        return True

    def put_many(self, batch: PutBatch, count_refused: bool = True) -> int:
        """Queue a (validated) batch, or as many of its first pages as the queue holds:
        their number (the rest is counted as skipped, unless not `count_refused`: a
        caller that offers them again later counts what it gives up itself). One queue item."""
        n, size = batch.n_pages, batch.page_bytes
        batch.charge = fmt.footprint(size, batch.token_bytes // 4, self._psize)
        with self.cond:
            room = self._admit(n, size, count_refused)
            if room:
                batch.n_pages = batch.pending = room
                batch.results = bytearray(room)
                self._push(BatchPart(batch, 0, room), room, room * size)
        return room

    def _admit(self, n: int, size: int, count: bool = True) -> int:
        """How many of n pages of `size` bytes the queue takes now, the others counted as
        skipped when `count` (all of them while writes are disabled or the queue closes).
        Under the lock."""
        if self.refuse_until and time.monotonic() < self.refuse_until:
            self._skipped_disabled += n if count else 0
            return 0
        room = 0 if self.closing else max(0, min(n, self.config.max_queue_pages - self._queued_pages,
                                                 (self.config.max_queue_bytes - self._queued_bytes) // size
                                                 if size else n))
        if count:
            self._skipped_queue_full += n - room
        return room

    def _push(self, op: PutOp | BatchPart, n: int, nbytes: int) -> None:
        self._ops.append(op)
        self._queued_pages += n
        self._queued_bytes += nbytes
        self._puts += n
        if self._writer_waiting:
            self.cond.notify()

    def delete(self, keys: list[bytes]) -> None:
        self.enqueue(DeleteOp(keys))

    def drop(self, key: bytes, checksum: tuple[int, int] | None) -> None:
        """Delete a corrupt entry unless it is rewritten before the writer gets to it."""
        self.enqueue(DropOp(key, checksum))

    def touch(self, keys: Iterable[bytes]) -> None:
        now = time.time()
        with self.cond:
            room = self.config.max_pending_touches - len(self.touches)
            for k in keys:
                if room <= 0:
                    break
                if k not in self.touches:
                    room -= 1
                self.touches[k] = now

    def enqueue(self, op: DeleteOp | DropOp | BarrierOp) -> bool:
        """Queue an op that carries no page (not bounded); False once closing."""
        with self.cond:
            if self.closing:
                return False
            self._ops.append(op)
            self._other_ops += 1
            self.cond.notify()
        return True

    def close(self) -> bool:
        """No more ops; wakes the writer to drain. True for the first call."""
        with self.cond:
            first = not self.closing
            self.closing = True
            self.cond.notify_all()
        return first

    def stats(self) -> dict:
        with self.cond:
            return dict(queue_depth=self._queued_pages + self._other_ops, queue_bytes=self._queued_bytes,
                        puts=self._puts, skipped_queue_full=self._skipped_queue_full,
                        skipped_disabled=self._skipped_disabled, pending_touches=len(self.touches))

    def take_touches(self) -> dict[bytes, float]:
        with self.cond:
            touches, self.touches = self.touches, {}
        return touches

    # ------------------------------------------------------------ the writer thread

    def take(self, batch_ops: int, batch_limit: int) -> tuple[list, bool]:
        """(the ops of the next transaction, whether the queue is closed and drained);
        waits for work, or returns no ops after ``touch_interval_s`` with touches pending."""
        with self.cond:
            while not self._ops and not self.closing:
                self._writer_waiting = True
                try:
                    if not self.cond.wait(self.config.touch_interval_s) and self.touches:
                        return [], False
                finally:
                    self._writer_waiting = False
            ops: list = []
            n_bytes = 0
            n_keys = 0  # puts and deleted keys: each copies up to a B-tree path per database
            queue, psize, footprint = self._ops, self._psize, fmt.footprint
            while queue and n_keys < batch_ops and n_bytes < batch_limit:
                op = queue.popleft()
                kind = type(op)
                if kind is PutOp:  # the common case of put_async first
                    ops.append(op)
                    n_keys += 1
                    self._queued_pages -= 1
                    self._queued_bytes -= op.page.nbytes
                    op.charge = footprint(op.page.nbytes, len(op.tokens) // 4, psize)
                    n_bytes += op.charge
                    continue
                if kind is BatchPart:  # as many of its pages as the transaction takes; the rest waits
                    charge = op.batch.charge
                    take = min(op.hi - op.lo, batch_ops - n_keys, -(-(batch_limit - n_bytes) // charge))
                    if take < op.hi - op.lo:
                        queue.appendleft(BatchPart(op.batch, op.lo + take, op.hi))
                        op = BatchPart(op.batch, op.lo, op.lo + take)
                    ops.append(op)
                    n_keys += take
                    n_bytes += take * charge
                    self._queued_pages -= take
                    self._queued_bytes -= take * op.batch.page_bytes
                    continue
                if kind is DeleteOp and n_keys + len(op.keys) > batch_ops:
                    room = max(1, batch_ops - n_keys)  # the rest waits for the next transaction
                    queue.appendleft(DeleteOp(op.keys[room:]))
                    op = DeleteOp(op.keys[:room])
                else:
                    self._other_ops -= 1
                ops.append(op)
                n_keys += len(op.keys) if kind is DeleteOp else 1
                if kind is BarrierOp:
                    break  # commit everything before it, then release the waiter (a barrier ends a batch)
            return ops, self.closing and not self._ops
