"""What the disk mover has in flight: a node's pages on their way to disk, the reads of a
match's disk part into host pages, and the arena views the writes copy from."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.daemon.core.service import NamespaceState
from hicache.index.radix import TreeNode


@dataclass(slots=True, frozen=True)
class PageViews:
    """Zero-copy views of one page size's slots in the arena (the daemon never imports torch)."""

    arena: np.ndarray
    page_bytes: int

    def page_view(self, slot: int) -> memoryview:
        return memoryview(self.arena[slot * self.page_bytes:(slot + 1) * self.page_bytes])

    def rows(self) -> np.ndarray:
        """The arena as (slots, page_bytes): row s is slot s (a batch of disk puts reads its rows)."""
        n = self.arena.size // self.page_bytes
        return self.arena[:n * self.page_bytes].reshape(n, self.page_bytes)


@dataclass(slots=True, eq=False)
class DiskWrite:
    """One node's pages on their way to disk (write-through or demotion), from its
    acceptance (in the backlog, hicache/daemon/movers/disk_writes.py) to its commit."""

    wid: int
    ns: NamespaceState
    node: TreeNode  # write-through: HOST- and DISK-locked until the write commits
    keys: Sequence[bytes]  # the node's keys when accepted (a KeyRun: a split may shorten node.keys)
    parent: bytes | None  # the key of the page above the first one (None: the namespace's root)
    tokens: np.ndarray  # the pages' tokens, page after page
    slots: np.ndarray | None  # write-through: the pages' host slots (locked: they stay the pages')
    rows: np.ndarray | None  # demotion: a copy of the pages (their slots are reused at once)
    n_pages: int
    remaining: int  # pages not reported committed or refused yet
    ok: bool = True
    started: float = 0.0
    demote: bool = False  # flagged on disk when queued; not locked (its host copy is going)
    handed: int = 0  # the first pages handed to the tier's queue so far


@dataclass(slots=True, eq=False)
class Prefetch:
    """Disk -> host reads for the disk part of one match."""

    nodes: list[tuple[TreeNode, int]]  # (node, end of its pages relative to the disk part), in path order
    host_pages: np.ndarray  # one per page of `nodes`, in order
    future: asyncio.Future | None
    loaded_pages: int = 0  # contiguous pages now host-resident and HOST-locked by the pin
    done: bool = False
    last_node: TreeNode | None = None
    started: float = field(default_factory=time.monotonic)
    promoted: list[TreeNode] = field(default_factory=list)  # exclusive placement: disk copies to drop
