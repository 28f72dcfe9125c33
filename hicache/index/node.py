"""The vocabulary of the radix index: tiers, tree nodes, what index operations
return, its errors, and the checks on what callers pass in (disk records included).

A node is a run of pages. Its residency is all-or-nothing per tier (per engine
for the device tier); RadixIndex splits nodes wherever residency would differ
inside one. Internally each independently evictable residency is a *lane*:
the device tier of engine `e` is lane `e` (engine ids are >= 0), the host tier
is `HOST_LANE`, the disk tier `DISK_LANE`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from hicache.errors import HiCacheError
from hicache.index.keys import KEY_BYTES, KEY_RUN_TYPES, KeyRun, PackedKeys, as_tokens


class IndexInputError(HiCacheError, ValueError):
    """An argument is malformed; the index did not change."""


class IndexStateError(HiCacheError):
    """The call conflicts with the index's state (stale node, lock underflow,
    clearing a locked tier); the index did not change."""


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


HOST_LANE = -1
DISK_LANE = -2


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


EMPTY_PAGES = _frozen(np.empty(0, dtype=np.int64))
EMPTY_TOKENS = _frozen(np.empty(0, dtype=np.int32))


# The maps of a node that has no device copy, device lock or child counted (most nodes at a
# million pages: an engine that stores by puts never has device pages): one shared, read-only
# empty map instead of three empty dicts a node (~200 B). Whoever writes one first replaces
# it with a dict (policy.py, tree_walk.py), and puts it back once the dict is empty again.
NO_ENTRIES: Mapping = MappingProxyType({})


@dataclass(slots=True, eq=False)
class TreeNode:
    """One run of pages. Identity matters (eq=False): callers hold nodes to lock them.

    When a node is split, the object keeps the *lower* part (and its children,
    its state checkpoint, its place in eviction heaps); a new node takes the
    upper part. A node a caller holds therefore always still ends where it did.
    """

    parent: TreeNode | None
    children: dict[bytes, TreeNode]      # keyed by the child's first page key
    keys: KeyRun                         # chained 16-byte page key per page, packed (keys.key_run)
    tokens: np.ndarray                   # int32, n_pages * page_size
    device: Mapping[int, np.ndarray] = field(default_factory=lambda: NO_ENTRIES)  # engine -> device page ids
    host: np.ndarray | None = None       # host page-slot ids (int64) or None
    on_disk: bool = False
    lock_ref: list[int] = field(default_factory=lambda: [0, 0, 0])  # per Tier, this node and below
    last_access: float = 0.0
    hit_count: int = 0
    state: object | None = None          # hybrid-model state checkpoint at the node's end
    policy_memo: tuple | None = None     # an EvictionPolicy's cached priority (see policy.py)
    # Bookkeeping of RadixIndex and its ResidencyLedger; read-only for everyone else.
    device_locks: Mapping[int | None, int] = field(default_factory=lambda: NO_ENTRIES)  # engine (None = all) -> refs
    child_lanes: Mapping[int, int] = field(default_factory=lambda: NO_ENTRIES)  # lane -> children resident in it
    queued: tuple[int, ...] = ()  # lanes with an entry in an eviction heap
    removed: bool = False

    @property
    def n_pages(self) -> int:
        return len(self.keys)

    @property
    def is_root(self) -> bool:
        return not self.keys

    @property
    def in_any_tier(self) -> bool:
        return bool(self.device) or self.host is not None or self.on_disk

    @property
    def is_locked(self) -> bool:
        """Locked in some tier (here or below): the node cannot be removed from the tree."""
        return any(self.lock_ref)

    def lanes(self) -> list[int]:
        out = list(self.device)
        if self.host is not None:
            out.append(HOST_LANE)
        if self.on_disk:
            out.append(DISK_LANE)
        return out

    def resident_in(self, lane: int) -> bool:
        if lane >= 0:
            return lane in self.device
        if lane == HOST_LANE:
            return self.host is not None
        return self.on_disk

    def lane_locked(self, lane: int) -> bool:
        """Locked in the lane's tier (for a device lane: by that engine or by a lock for all)."""
        if lane >= 0:
            dl = self.device_locks
            return bool(dl) and (dl.get(lane, 0) > 0 or dl.get(None, 0) > 0)
        return self.lock_ref[Tier.HOST if lane == HOST_LANE else Tier.DISK] > 0

    def __repr__(self) -> str:  # the default would print every array
        tiers = [f"dev{sorted(self.device)}"] if self.device else []
        if self.host is not None:
            tiers.append("host")
        if self.on_disk:
            tiers.append("disk")
        key = self.keys[0].hex()[:8] if self.keys else "root"
        return (f"TreeNode({key}, pages={self.n_pages}, {'+'.join(tiers) or 'no tier'}, "
                f"lock={self.lock_ref}, children={len(self.children)})")


@dataclass(slots=True)
class MatchResult:
    """The usable prefix of a request, by segment: this engine's device pages,
    then pages with a host copy, then pages available on disk (or host).
    Each segment ends at a node boundary, so a caller locks a segment by
    locking its last node. The lists may share (device_nodes can be `nodes`
    itself) and the page arrays may be a node's own: read them, never change them."""

    nodes: list[TreeNode]
    device_nodes: list[TreeNode]
    host_nodes: list[TreeNode]
    disk_nodes: list[TreeNode]
    device_pages: np.ndarray   # int64, this engine's device page ids (read-only)
    host_pages: np.ndarray     # int64, host slot ids (read-only)
    disk_keys: list[bytes]
    last_node: TreeNode        # the root when nothing matched

    @property
    def device_len(self) -> int:
        return len(self.device_pages)

    @property
    def host_len(self) -> int:
        return len(self.host_pages)

    @property
    def disk_len(self) -> int:
        return len(self.disk_keys)

    @property
    def num_pages(self) -> int:
        return len(self.device_pages) + len(self.host_pages) + len(self.disk_keys)


@dataclass(slots=True)
class InsertResult:
    present_pages: int           # pages already in the tree before this insert
    dup_device_pages: np.ndarray  # the caller's device pages not adopted (and not the index's
                                  # own ids): the caller frees them
    dup_host_pages: np.ndarray    # same for host slots
    nodes: list[TreeNode]        # the full path for the inserted keys
    new_nodes: list[TreeNode]    # nodes created for pages that were absent


@dataclass(slots=True)
class Freed:
    """Residency an operation released; the caller frees the slots or deletes the disk keys."""

    tier: Tier
    engine: int | None           # the engine for DEVICE, else None
    keys: list[bytes]
    slots: np.ndarray | None     # int64 device page ids or host slot ids; None for DISK


class DiskRecord(NamedTuple):
    """Per-page metadata the disk tier keeps so the tree can be rebuilt after a restart.
    A plain 4-tuple in this order is accepted as well."""

    key: bytes
    parent_key: bytes            # the namespace salt for a sequence's first page
    tokens: np.ndarray           # int32, one page
    last_access: float           # in the index clock's units


def lane_tier(lane: int) -> tuple[Tier, int | None]:
    if lane >= 0:
        return Tier.DEVICE, lane
    return (Tier.HOST if lane == HOST_LANE else Tier.DISK), None


class FreedCollector:
    """Collects released residency per lane; one Freed per lane at the end."""

    __slots__ = ("by_lane",)

    def __init__(self) -> None:
        self.by_lane: dict[int, tuple[list[bytes], list[np.ndarray]]] = {}

    def add(self, lane: int, keys: list[bytes], slots: np.ndarray | None) -> None:
        entry = self.by_lane.get(lane)
        if entry is None:
            entry = self.by_lane[lane] = ([], [])
        entry[0].extend(keys)
        if slots is not None:
            entry[1].append(slots)

    def build(self) -> list[Freed]:
        out = []
        for lane, (keys, slots) in self.by_lane.items():
            tier, engine = lane_tier(lane)
            out.append(Freed(tier, engine, keys, None if tier is Tier.DISK else concat_pages(slots)))
        return out


def concat_pages(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return EMPTY_PAGES
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays)


def segment_pages(path: list[TreeNode], n_dev: int, n_host: int, lane: object) -> tuple[np.ndarray, np.ndarray]:
    """The page arrays of a matched path's device segment (its first n_dev nodes, the
    engine's lane) and host segment (the next n_host). A one-node segment's array is
    taken as is: this runs on every match, and on a short path costs more than the walk."""
    if n_dev == 1:
        device_pages = path[0].device[lane]
    else:
        device_pages = concat_pages([x.device[lane] for x in path[:n_dev]]) if n_dev else EMPTY_PAGES
    if n_host == 1:
        host_pages = path[n_dev].host
    else:
        host_pages = concat_pages([x.host for x in path[n_dev:n_dev + n_host]]) if n_host else EMPTY_PAGES
    return device_pages, host_pages


def not_own(theirs: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The caller's ids that are duplicates: those differing from the index's own ids
    at the same positions (ids it got from match are the same pages, not copies)."""
    return theirs[theirs != own]


# ---------------------------------------------------------------------- argument checks

def check_keys(keys: object) -> list[bytes]:
    if type(keys) is PackedKeys:
        return keys  # validated when it was built from its blob
    if isinstance(keys, KEY_RUN_TYPES):  # a node's own keys
        return PackedKeys(bytes(keys))
    if type(keys) is not list:
        if not isinstance(keys, (list, tuple)):
            raise IndexInputError("keys must be a list of bytes")
        keys = list(keys)
    if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}):
        raise IndexInputError(f"every key must be {KEY_BYTES} bytes")
    return keys


def check_tokens(tokens: object, n_pages: int, page_size: int) -> np.ndarray:
    try:
        toks = as_tokens(tokens)
    except (TypeError, ValueError, OverflowError) as e:
        raise IndexInputError(f"bad tokens: {e}") from e
    if len(toks) != n_pages * page_size:
        raise IndexInputError(f"{len(toks)} tokens for {n_pages} pages of {page_size}")
    return toks


def check_pages(pages: object, n: int | None, name: str) -> np.ndarray:
    """A private, read-only copy of a 1-D int64 array of ids (the caller may reuse its buffer)."""
    if not isinstance(pages, np.ndarray) or pages.dtype != np.int64 or pages.ndim != 1:
        raise IndexInputError(f"{name} must be a 1-D int64 numpy array")
    if n is not None and len(pages) != n:
        raise IndexInputError(f"{name} has {len(pages)} entries for {n} pages")
    if len(pages) and pages.min() < 0:
        raise IndexInputError(f"{name} holds a negative id")
    return _frozen(pages.copy())


def check_engine(engine: object) -> int:
    if type(engine) is int and engine >= 0:
        return engine
    return _non_negative(engine, "engine")


def check_count(num_pages: object) -> int:
    return _non_negative(num_pages, "num_pages")


def _non_negative(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise IndexInputError(f"{name} must be an int")
    try:
        v = operator.index(value)
    except TypeError as err:
        raise IndexInputError(f"{name} must be an int") from err
    if v < 0:
        raise IndexInputError(f"{name} must be >= 0")
    return v


def check_tier(tier: object) -> Tier:
    if type(tier) is Tier:
        return tier  # the common case, without Enum's lookup
    try:
        return Tier(tier)
    except ValueError as err:
        raise IndexInputError(f"no tier {tier!r}") from err
