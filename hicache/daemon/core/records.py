"""The records the engine cycle, the ingest paths and the tier movers share.

A namespace's state (its index and host page class), a registered engine, a
match handle (Pin), the counters `hicache stats` reports. Plain slotted records
with no behaviour beyond a path walk: every daemon module may import this one,
and it imports nothing of the daemon but the host tier's page class, so the
engine cycle (service.py) and the slab reclaim (slab_reclaim.py) both build on
it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.daemon.core.host_tier import PageClass
from hicache.index.keys import Namespace
from hicache.index.node import Tier, TreeNode
from hicache.index.radix import RadixIndex

EMPTY = np.empty(0, dtype=np.int64)
TIER_NAMES = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk"}


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace: Namespace
    salt: bytes
    index: RadixIndex
    page_class: PageClass
    engines: set[int] = field(default_factory=set)
    # Engines that store by puts or keyed stores (vLLM, SGLang) report no whole requests
    # (no insert): their lookups tell the disk admission what is requested instead.
    lookups_feed_admission: bool = False
    restoring: bool = False  # its disk pages are being indexed (movers/disk_restore.py): kept


@dataclass(slots=True, eq=False)
class EngineRecord:
    engine_id: int
    owner: object  # the connection that registered it
    ns: NamespaceState
    device_pages: int
    reclaim: list[np.ndarray] = field(default_factory=list)  # device pages dropped by others' removals
    prefill_tokens_per_s: float = 0.0  # as the engine reported it; 0: unknown (fetch_or_recompute.py)


@dataclass(slots=True, eq=False)
class Pin:
    pin_id: int
    engine: EngineRecord
    locks: list[tuple[TreeNode, Tier, int | None]]  # (node, tier, engine for DEVICE locks)
    device_len: int
    host_len: int
    disk_len: int
    host_node: TreeNode | None  # last node of the host segment (for load_done)
    device_pages: np.ndarray
    host_pages: np.ndarray
    loaded: bool = False
    prefetch: Any = None  # the disk tier's reads for the disk part (see DiskMover)
    remote: Any = None  # the remote tier's lookup and fetch after the disk part (remote_lookup.py), in disk_len
    recompute_from: int | None = None  # pages: the match stopped here, the rest is cheaper to recompute


@dataclass(slots=True)
class Counters:
    matches: int = 0
    matched_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    requested_pages: int = 0
    inserts: int = 0
    inserted_pages: int = 0
    backups_planned: int = 0
    backup_pages: int = 0
    backups_skipped_no_space: int = 0
    evicted_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    loaded_pages: int = 0
    bytes_host_to_device: int = 0  # reported by engines' load_done / backup_done
    bytes_device_to_host: int = 0
    slabs_reclaimed: int = 0  # host slabs emptied for another namespace (slab_reclaim.py)


def path_with_offsets(node: TreeNode) -> list[tuple[TreeNode, int]]:
    """The nodes from the root down to `node`, each with its first page's position."""
    chain: list[TreeNode] = []
    while node is not None and node.parent is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    out: list[tuple[TreeNode, int]] = []
    pos = 0
    for n in chain:
        out.append((n, pos))
        pos += n.n_pages
    return out
