"""What the disk writer (hicache/tiers/disk/writer.py) does when a write transaction
fails: make room and retry, commit op by op, and disable writes on a fault.

- ``MapFullError`` or any other LMDB error aborts the batch; the writer then
  evicts through the hook, commits twice so the freed pages become reusable
  (LMDB reuses a page freed by transaction T only from T+2 on), retries the
  batch once and otherwise commits it op by op: what fits goes in, the rest is
  rejected. A deletion that cannot commit is kept for the next transaction.
- A fault: when not even one op of a batch commits on its own, for a reason
  other than the budget, writes are disabled for ``write_retry_s``; queued
  batches are refused without touching the disk (``_refuse``) until then. The
  writer's docstring has the whole contract.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import lmdb

from hicache.tiers.disk.batch import BatchPart, expand_all
from hicache.tiers.disk.ops import DeleteOp, DropOp, PutOp

if TYPE_CHECKING:
    from hicache.tiers.disk.config import DiskTierConfig
    from hicache.tiers.disk.queue import WriteQueue

log = logging.getLogger(__name__)


class WriteRecovery:
    """Mixed into DiskWriter (hicache/tiers/disk/writer.py), which owns the state below."""

    if TYPE_CHECKING:  # DiskWriter's
        path: str
        config: DiskTierConfig
        queue: WriteQueue
        _w: dict[str, int]
        _fault: str
        _faults: int
        _op_fault: BaseException | None
        _doomed: dict[bytes, bool]
        _drops: dict[bytes, tuple[int, int] | None]

        def warn(self, msg: str, *args: object) -> None: ...
        def _commit(self, ops: list, force_touch: bool) -> list[tuple[PutOp, bool]]: ...
        def _call_hook(self, bytes_needed: int) -> list[bytes]: ...

    def _commit_op_by_op(self, ops: list, force_touch: bool) -> list[tuple[PutOp, bool]]:
        """Commit op by op (a batch page by page), in order: what fits goes in, the rest is
        rejected; when none commits for a reason other than the budget, writes are disabled."""
        results: list[tuple[PutOp, bool]] = []
        self._op_fault = None
        committed = 0
        for op in expand_all(ops):
            res, ok = self._commit_alone(op, force_touch)
            results += res
            committed += ok
        if not committed and self._op_fault is not None:
            self._disable(self._op_fault)
        return results

    def _commit_alone(self, op: object, force_touch: bool) -> tuple[list[tuple[PutOp, bool]], bool]:
        try:
            return self._commit([op], force_touch), True
        except Exception as e:
            self._w["write_errors"] += 1
            if not isinstance(e, lmdb.MapFullError):
                self._op_fault = e
            return self._keep_or_reject(op, e), False

    def _keep_or_reject(self, op: object, e: BaseException | None) -> list[tuple[PutOp, bool]]:
        """An op that could not be committed: a put is rejected (counted), a deletion
        is kept for the next transaction (never lost)."""
        if isinstance(op, PutOp):
            self._w["rejected_errors"] += 1
            log.debug("disk tier %s: put %s rejected: %s", self.path, op.key.hex(), e)
            return [(op, False)]
        if isinstance(op, BatchPart):  # only while writes are disabled: a failed batch retries page by page
            op.reject()
            return [(op, None)]
        if isinstance(op, DeleteOp):
            self._doomed.update(dict.fromkeys(op.keys, False))
        elif isinstance(op, DropOp):
            self._drops[op.key] = op.checksum
        return []

    def _refuse(self, ops: list) -> list[tuple[PutOp, bool]]:
        """While writes are disabled: reject the batch without touching the disk."""
        results: list[tuple[PutOp, bool]] = []
        for op in ops:
            results += self._keep_or_reject(op, None)
        return results

    def _disable(self, e: BaseException) -> None:
        self.queue.refuse_until = time.monotonic() + self.config.write_retry_s  # puts are refused until then too
        if not self._fault:
            self._faults += 1
            log.error("disk tier %s: writes disabled: a batch failed even op by op (%s: %s); reads go on, "
                      "retrying in %.0fs", self.path, type(e).__name__, e, self.config.write_retry_s)
        self._fault = f"{type(e).__name__}: {e}"

    def _make_room(self, bytes_needed: int) -> None:
        """After a failed transaction: delete hook-chosen keys in their own
        commit, then commit once more so the freed pages become reusable."""
        self._call_hook(max(bytes_needed, 1))
        try:
            self._commit([], False)  # deletes the doomed keys (transaction T)
            self._commit([], False)  # T+1: pages freed by T are reusable from here on
        except lmdb.Error as e:
            self.warn("could not free space: %s", e)
