"""The records HybridStates (hicache/daemon/hybrid/states.py) and HybridDiskMover
(hicache/daemon/hybrid/disk.py) share, and the narrow view of HybridStates the
mover works through, so that imports flow one way:
hybrid -> hybrid_disk -> hybrid_types."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hicache.daemon.core.host_tier import PageClass
from hicache.daemon.core.service import CacheService, NamespaceState, Pin
from hicache.index.checkpoints import Checkpoint, CheckpointIndex, EvictedState
from hicache.state_layout import StateLayout


@dataclass(slots=True, eq=False)
class StatePrefetch:
    """A disk -> host read of one checkpoint for a pin."""

    ckpt: Checkpoint
    host_slot: int
    future: asyncio.Future | None = None
    done: bool = False


@dataclass(slots=True, eq=False)
class NsStates:
    """One hybrid namespace's checkpoints."""

    ns: NamespaceState
    layout: StateLayout
    ckpts: CheckpointIndex
    slots: PageClass  # host state slots
    disk_salt: bytes


@dataclass(slots=True, eq=False)
class StatePin:
    """The state side of one match: what the request may restore."""

    pin: Pin
    hs: NsStates
    kv_tokens: int                 # the whole KV match, before the cut at the checkpoint
    fork_tokens: int | None        # where the request leaves the tree inside a node
    best: Checkpoint | None        # locked
    fallback: Checkpoint | None    # locked: deepest host copy above a disk-only `best`
    prefetch: StatePrefetch | None = None


@dataclass(slots=True)
class StateCounters:
    matches: int = 0
    usable_tokens: int = 0
    kv_tokens: int = 0
    stored: int = 0
    skipped_no_space: int = 0
    evicted: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    tombstones: int = 0
    disk_writes: int = 0
    disk_reads: int = 0
    disk_misses: int = 0
    restored: int = 0
    disk_orphans: int = 0  # records dropped at the rebuild: their KV end page was not on disk


class StateHost(Protocol):
    """What HybridDiskMover needs from HybridStates (which implements it)."""

    svc: CacheService
    disk_budget: int
    counters: StateCounters
    pins: dict[int, StatePin]

    def of(self, ns: NamespaceState) -> NsStates | None: ...

    def alloc_host(self, hs: NsStates, n: int) -> np.ndarray | None: ...

    def free_host(self, hs: NsStates, slots: Iterable[int]) -> None: ...

    def evict_one_disk(self) -> bool: ...

    def drop_evicted(self, hs: NsStates, evicted: list[EvictedState]) -> None: ...

    def host_view(self, hs: NsStates, slot: int) -> memoryview: ...
