"""The disk writer's queue entries (hicache/tiers/disk/writer.py): puts, deletions,
drops of corrupt entries, barriers, and the hasher thread's jobs for big pages."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hicache.tiers.disk import format as fmt

OnDone = Callable[[bytes, bool], None]


@dataclass(slots=True)
class PutOp:
    salt: bytes
    key: bytes
    parent: bytes | None
    tokens: bytes
    page: memoryview
    on_done: OnDone | None
    parent_required: bool = True
    digest: tuple[int, int] | None = None  # kept for a retry of the batch
    job: HashJob | None = None  # computes `digest` on the hasher thread
    charge: int = 0  # footprint in the map (disk_format.footprint), set when a batch takes it


HASH_OFFLOAD_BYTES = 1 << 20  # smaller pages are hashed inline: the hand-off costs more


class HashJob:
    """XXH3 of one batch's big pages, in order, on the hasher thread while the writer
    copies earlier pages into the map (one task per batch: cheaper than a future each)."""

    def __init__(self, ops: list[PutOp]) -> None:
        self.ops = ops
        self.cond = threading.Condition(threading.Lock())
        self.finished = False

    def run(self) -> None:
        try:
            for op in self.ops:
                digest = fmt.checksum(op.page)
                with self.cond:
                    op.digest = digest
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def digest(self, op: PutOp) -> tuple[int, int]:
        with self.cond:
            self.cond.wait_for(lambda: op.digest is not None or self.finished)
        if op.digest is None:  # the job failed before this page: hash it here
            op.digest = fmt.checksum(op.page)
        return op.digest


def native_ok(op: object) -> bool:
    """A put the C loop takes: pages it hashes itself (not one of a hasher job, nor a retry
    that carries its digest)."""
    return type(op) is PutOp and op.job is None and op.digest is None


@dataclass(slots=True)
class DeleteOp:
    keys: list[bytes]


@dataclass(slots=True)
class DropOp:
    """Delete corrupt entry `key` unless it was rewritten since a reader saw it
    (its record's checksum is still `checksum`; None: the record was malformed)."""

    key: bytes
    checksum: tuple[int, int] | None


@dataclass(slots=True)
class BarrierOp:
    done: threading.Event
