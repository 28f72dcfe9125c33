"""The radix index of one namespace, shared by every tier.

A radix tree over pages. Keys are the chained page keys of hicache.index.keys:
page key i of two sequences is equal iff their tokens are equal up to the end
of page i. So inside a node the common prefix with a request is found by
binary search on key equality, children are looked up by their first key,
and no operation loops over tokens in Python.

Residency. A node is on an engine's device (that engine's page ids), in the
host arena (slot ids), on disk (a flag), in any combination. Residency is
all-or-nothing per node, per tier and per engine: an operation that would
make it differ inside a node first splits the node at that page boundary.
A split slices the arrays, copies lock refs to both halves and keeps the
children, the state checkpoint and the object identity with the *lower*
half, so a node a caller holds still ends where it did.

match(keys, engine) walks from the root and returns three segments: leading
nodes on `engine`'s device; then nodes with a host copy; then nodes on disk
(or in host). The walk stops at the first node that fits none, and splits a
node where the request diverges or ends inside it, so every segment ends at
a node boundary. Matched nodes get `last_access = clock()` and
`hit_count += 1`. match does not lock: the caller locks what it uses
(lock_match), or calls match_locked, which does both in one step (locks.py).

insert(keys, tokens, ...) walks the same way. For pages already present it
adopts the caller's device pages (host slots) where this engine (the host)
has none, and reports the caller's ids as duplicates where it has -- except
ids equal to the index's own there: passing back the prefix one matched is
not a duplicate. on_disk is OR-ed. Absent pages become one new leaf. An
insert must give some residency: every node is in at least one tier.

Locks (locks.py). lock(node, tier) adds a ref on the node and all its ancestors; a
device lock names an engine (None protects every engine's copy). Resident
pages count as protected in a tier while locked there, else as evictable;
both counts are kept incrementally. A locked node is never removed.

Eviction. Per lane (one engine's device, host, disk) a heap holds the
candidates: nodes resident in the lane, with no child resident in it and no
lock on it. Entries are checked when they reach the top (lazy deletion) and
pushed back if their priority has grown (see policy.py); nothing is
re-heapified per call. Evicting (eviction.py) drops the lane's residency;
a node left in no tier is removed with its whole subtree, and all of that
subtree's residency is reported as Freed, so nothing leaks. A node left in no tier
while still locked (the engine holding its only copy went away, or a lock
below it) stays, never matched, until its last unlock removes it.

Freed records. Every method returning list[Freed] also hands over those of
removals that happened where no list could be returned (unlock, clear_*,
set_disk); take_freed() returns them on demand.

Not thread-safe: one event loop owns an index.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from hicache.index.eviction import EvictionOps
from hicache.index import native_index, restore
from hicache.index.key_map import KeyMap
from hicache.index.locks import LockOps
from hicache.index.keys import KEY_BYTES, PackedKeys, key_run
from hicache.index.node import (
    DISK_LANE, EMPTY_PAGES, EMPTY_TOKENS, HOST_LANE, DiskRecord, Freed, FreedCollector, IndexInputError,
    IndexStateError, InsertResult, MatchResult, Tier, TreeNode, check_count, check_engine, check_keys,
    check_pages, check_tier, check_tokens, concat_pages, not_own, segment_pages,
)
from hicache.index.policy import EvictionPolicy, LruPolicy, ResidencyLedger, count_child
from hicache.index.tree_walk import (
    check_live, common_pages, path_to_root, preorder, split_node, suffix_chain, walk_path,
)

__all__ = ["DiskRecord", "Freed", "IndexInputError", "IndexStateError", "InsertResult", "MatchResult",
           "RadixIndex", "Tier", "TreeNode"]

_NO_LANE = -3  # match without an engine: no device segment


class RadixIndex(LockOps, EvictionOps):
    """Radix tree over the pages of one namespace, across device, host and disk."""

    def __init__(self, page_size: int, salt: bytes, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if type(page_size) is not int or page_size < 1:
            raise IndexInputError(f"page_size must be a positive int, got {page_size!r}")
        if type(salt) is not bytes or len(salt) != KEY_BYTES:
            raise IndexInputError(f"salt must be {KEY_BYTES} bytes")
        self.page_size = page_size
        self.salt = salt
        self.policy = policy if policy is not None else LruPolicy()
        self.clock = clock
        self.root = TreeNode(parent=None, children={}, keys=key_run(b""), tokens=EMPTY_TOKENS)
        # Page key -> hint priority, kept by hicache/index/priorities.py: orders eviction
        # before the policy does (policy.py). Call refresh_order() after lowering any.
        self.hint_priority: dict[bytes, int] = {}
        self._ledger = ResidencyLedger(self.root, self.policy, self.hint_priority)
        self._outbox: list[Freed] = []
        self.key_map: KeyMap | None = None  # keyed namespaces only (enable_key_map)
        self._native_walk = self._native_lock = self._native_unlock = self._native_walk_lock = None
        self.use_native(native_index.load())  # built once per process; None: all in Python

    def use_native(self, mod: object) -> None:
        """Walk, lock and unlock with the C loops of native_index.py (None: in Python; the
        tests run both on the same operations and compare)."""
        self._native_walk = None if mod is None else mod.walk
        self._native_lock = None if mod is None else mod.lock_segments
        self._native_unlock = None if mod is None else mod.unlock_node
        self._native_walk_lock = None if mod is None else mod.walk_lock
        self._ledger.use_native(mod)

    # ------------------------------------------------------------------ match / insert

    def match(self, keys: list[bytes], engine: int | None = None) -> MatchResult:
        keys = check_keys(keys)
        lane = _NO_LANE if engine is None else check_engine(engine)
        now = self.clock()
        seg = 0 if engine is not None else 1   # 0 device, 1 host, 2 disk
        walk = self._native_walk
        if walk is not None and type(keys) is PackedKeys:  # keys off the wire: the walk in C
            path, n_dev, n_host, j = walk(self.root, keys.blob, lane, seg, now)
            if j >= 0:  # diverged or ended inside the last node: split it there, as below
                self._split_walked(path, j, now)
        else:
            path, n_dev, n_host = walk_path(self.root, keys, lane, seg, now, self.page_size)
        n_front = n_dev + n_host
        n_path = len(path)
        # Built positionally, one page array taken as is where a segment is one node:
        # this runs on every match, and on a short path costs more than the walk.
        dev_nodes = path if n_dev == n_path else path[:n_dev]
        host_nodes = path[n_dev:n_front] if n_host else []
        if n_front == n_path:
            disk_nodes, disk_keys = [], []
        else:
            disk_nodes = path[n_front:]
            disk_keys = list(itertools.chain.from_iterable(x.keys for x in disk_nodes))
        device_pages, host_pages = segment_pages(path, n_dev, n_host, lane)
        return MatchResult(path, dev_nodes, host_nodes, disk_nodes, device_pages, host_pages, disk_keys,
                           path[-1] if path else self.root)

    def insert(self, keys: list[bytes], tokens: np.ndarray, *, engine: int | None = None,
               device_pages: np.ndarray | None = None, host_pages: np.ndarray | None = None,
               on_disk: bool = False) -> InsertResult:
        """Add a sequence (len(tokens) == len(keys) * page_size) with the residency
        given; see the module docstring for what is adopted and what is a duplicate."""
        keys = check_keys(keys)
        n = len(keys)
        toks = check_tokens(tokens, n, self.page_size)
        lane = None if engine is None else check_engine(engine)
        dev = None
        if device_pages is not None:
            if lane is None:
                raise IndexInputError("device_pages need an engine")
            dev = check_pages(device_pages, n, "device_pages")
        host = None if host_pages is None else check_pages(host_pages, n, "host_pages")
        if type(on_disk) is not bool:
            raise IndexInputError("on_disk must be a bool")
        if n == 0:
            return InsertResult(0, EMPTY_PAGES, EMPTY_PAGES, [], [])
        if dev is None and host is None and not on_disk:
            raise IndexInputError("insert needs device_pages, host_pages or on_disk: "
                                  "a node must be in at least one tier")
        return self._insert_from(self.root, keys, toks, lane, dev, host, on_disk, self.clock(), True)

    def _insert_from(self, start: TreeNode, keys: list[bytes], tokens: np.ndarray, lane: int | None,
                     dev: np.ndarray | None, host: np.ndarray | None, on_disk: bool,
                     now: float, touch: bool) -> InsertResult:
        ledger = self._ledger
        node = start
        n = len(keys)
        i = 0
        path: list[TreeNode] = []
        dup_dev: list[np.ndarray] = []
        dup_host: list[np.ndarray] = []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            j = common_pages(child.keys, keys, i)
            if j < len(child.keys):
                child = self._split(child, j)
            if touch:
                child.last_access = now
            if dev is not None:
                own = child.device.get(lane)
                if own is None:
                    ledger.add_lane(child, lane, dev[i:i + j])
                else:
                    dup_dev.append(not_own(dev[i:i + j], own))
            if host is not None:
                if child.host is None:
                    ledger.add_lane(child, HOST_LANE, host[i:i + j])
                else:
                    dup_host.append(not_own(host[i:i + j], child.host))
            if on_disk and not child.on_disk:
                ledger.add_lane(child, DISK_LANE, None)
            path.append(child)
            node = child
            i += j
        present = i
        new_nodes: list[TreeNode] = []
        if i < n:
            ps = self.page_size
            rest = keys.blob[i * KEY_BYTES:] if type(keys) is PackedKeys else keys[i:]
            leaf = TreeNode(parent=node, children={}, keys=key_run(rest), tokens=tokens[i * ps:].copy(),
                            last_access=now)
            node.children[keys[i]] = leaf
            if dev is not None:
                ledger.add_lane(leaf, lane, dev[i:])
            if host is not None:
                ledger.add_lane(leaf, HOST_LANE, host[i:])
            if on_disk:
                ledger.add_lane(leaf, DISK_LANE, None)
            path.append(leaf)
            new_nodes.append(leaf)
            if self.key_map is not None:
                self.key_map.add(leaf)
        return InsertResult(present, concat_pages(dup_dev), concat_pages(dup_host), path, new_nodes)

    def host_prefix(self, keys: list[bytes]) -> tuple[TreeNode, int]:
        """The node ending the leading run of `keys` that has a host copy, and its length in
        pages (the root and 0 when the first page has none). Splits the node the run ends
        inside, so the caller can lock exactly that run; touches no access times (a store
        is not a hit)."""
        return self._held_prefix(keys, lambda x: x.host is not None)

    def stored_prefix(self, keys: list[bytes]) -> tuple[TreeNode, int]:
        """As host_prefix, for the leading run of `keys` the daemon holds itself (a host
        copy or on disk): what a pin can keep (hicache/index/pins.py)."""
        return self._held_prefix(keys, lambda x: x.host is not None or x.on_disk)

    def _held_prefix(self, keys: list[bytes], held: Callable[[TreeNode], bool]) -> tuple[TreeNode, int]:
        keys = check_keys(keys)
        node, i, n = self.root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None or not held(child):
                break
            j = common_pages(child.keys, keys, i)
            if j < len(child.keys):
                return self._split(child, j), i + j
            node, i = child, i + j
        return node, i

    def extend_host(self, parent: TreeNode, keys: list[bytes], tokens: np.ndarray,
                    host_pages: np.ndarray) -> InsertResult:
        """insert() of host-resident pages continuing the path that ends at `parent` (a
        live node or the root) without walking from the root: pages fetched from a remote
        store for a prefix whose tokens the caller does not hold, or the pages of a host put
        below the run `host_prefix` returned (and the caller kept locked since)."""
        if parent is not self.root:
            self._path(parent)  # live, and of this index
        keys = check_keys(keys)
        n = len(keys)
        toks = check_tokens(tokens, n, self.page_size)
        host = check_pages(host_pages, n, "host_pages")
        if n == 0:
            return InsertResult(0, EMPTY_PAGES, EMPTY_PAGES, [], [])
        return self._insert_from(parent, keys, toks, None, None, host, False, self.clock(), True)

    # ------------------------------------------------------------------ keyed chains

    def enable_key_map(self) -> None:
        """Keep a key -> node map from now on (key_map.py): pages asked about mid-path."""
        if self.key_map is None:
            self.key_map = KeyMap()
            for node in self._preorder():
                self.key_map.add(node)

    def find_key(self, key: bytes, *, split: bool = False) -> TreeNode | None:
        """The live node holding `key`'s page (enable_key_map first); with `split`, the
        node that ends at it (a chain continues below its last page)."""
        node = self.key_map.find(key) if self.key_map is not None else None
        if node is not None and split and node.keys[-1] != key:
            node = self._split(node, node.keys.index(key) + 1)
        return node

    def touch(self, node: TreeNode) -> None:
        """A hit found without a walk (find_key): what match does to the nodes it passes."""
        node.last_access = self.clock()
        node.hit_count += 1

    def adopt(self, parent: TreeNode, node: TreeNode) -> bool:
        """Hang `node`, a child of the root holding no lock anywhere below it, under
        `parent` (a chain root whose parent page arrived later). False, changing
        nothing, when it does not fit: `parent` lies below `node`, or already has a
        child starting with `node`'s first key."""
        check_live(node)
        if parent is not self.root:
            check_live(parent)
        if node.parent is not self.root or any(node.lock_ref) or node.keys[0] in parent.children:
            return False
        x = parent
        while x is not None:
            if x is node:
                return False
            x = x.parent
        del self.root.children[node.keys[0]]
        node.parent = parent
        parent.children[node.keys[0]] = node
        if parent is not self.root:  # the root keeps no counts; the parent is no leaf of these lanes now
            for lane in node.lanes():
                count_child(parent, lane)
        return True

    def node_ending_at(self, keys: list[bytes]) -> TreeNode | None:
        """The node whose path from the root is exactly `keys`, splitting the node the
        path ends inside (so a hybrid-model checkpoint can sit at that node's end);
        None when the keys leave the tree or are empty. No residency changes."""
        keys = check_keys(keys)
        node, i, n = self.root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                return None
            j = common_pages(child.keys, keys, i)
            if i + j < n and j < len(child.keys):
                return None  # diverges inside the node
            if j < len(child.keys):
                return self._split(child, j)  # the new upper part ends where the keys do
            node, i = child, i + j
        return node if node is not self.root else None

    def take_removed_states(self) -> list[object]:
        """The `state` of every node removed since the last call (hybrid-model
        checkpoints whose KV went away): the caller frees what they hold."""
        out = self._ledger.removed_states
        self._ledger.removed_states = []
        return out

    def _split_walked(self, path: list[TreeNode], j: int, now: float) -> None:
        """The C walk stopped inside path[-1], after its first j keys (the keys diverged or
        ended there): split it, as the Python walk does, and touch the part matched."""
        upper = path[-1] = self._split(path[-1], j)
        upper.last_access = now
        upper.hit_count += 1

    def _split(self, node: TreeNode, j: int) -> TreeNode:
        """Split `node` after its first j pages; return the new upper node."""
        return split_node(node, j, self.page_size)

    # ------------------------------------------------------------------ residency

    def set_device(self, node: TreeNode, engine: int, pages: np.ndarray) -> np.ndarray:
        """Put the last len(pages) pages of the path ending at `node` on `engine`'s
        device. Where the engine already has pages, the caller's ids are returned as
        duplicates (the caller frees them). Covering a path suffix, rather than one
        node, stays right when the node was split since the caller matched it."""
        return self._set_lane(node, check_engine(engine), pages)

    def set_host(self, node: TreeNode, pages: np.ndarray) -> np.ndarray:
        """As set_device, for host slots."""
        return self._set_lane(node, HOST_LANE, pages)

    def set_disk(self, node: TreeNode, flag: bool, num_pages: int | None = None) -> None:
        """Mark `node` (or the last num_pages pages of the path ending at it) as on disk
        or not. Unmarking a node locked in DISK raises IndexStateError."""
        if type(flag) is not bool:
            raise IndexInputError("flag must be a bool")
        check_live(node)
        count = node.n_pages if num_pages is None else check_count(num_pages)
        chain = self._suffix_chain(node, count)
        if not flag:
            for x in chain:
                if x.on_disk and x.lock_ref[Tier.DISK]:
                    raise IndexStateError(f"{x!r} is locked in DISK")
        self._split_chain_top(chain, count)
        acc = FreedCollector()
        for x in chain:
            if flag and not x.on_disk:
                self._ledger.add_lane(x, DISK_LANE, None)
            elif not flag and x.on_disk:
                self._ledger.drop_lane(x, DISK_LANE)
                self._ledger.reap(x, acc)
        self._outbox.extend(acc.build())

    def clear_device(self, node: TreeNode, engine: int) -> np.ndarray:
        """Drop `engine`'s copy of `node`; return its page ids (empty if none)."""
        lane = check_engine(engine)
        self._path(node)
        if lane not in node.device:
            return EMPTY_PAGES
        if node.lane_locked(lane):
            raise IndexStateError(f"{node!r} is locked on the device of engine {lane}")
        return self._clear(node, lane)

    def clear_host(self, node: TreeNode) -> np.ndarray | None:
        """Drop the host copy of `node`; return its slot ids (None if it had none)."""
        self._path(node)
        if node.host is None:
            return None
        if node.lock_ref[Tier.HOST]:
            raise IndexStateError(f"{node!r} is locked in HOST")
        return self._clear(node, HOST_LANE)

    def relocate_host(self, node: TreeNode, slots: np.ndarray) -> np.ndarray:
        """Give `node`'s host copy new slot ids, one per page (the caller moved the
        bytes); returns the old ids. Refused while the node is locked in HOST: a
        reader may be copying from the old slots."""
        self._path(node)
        if node.host is None:
            raise IndexStateError(f"{node!r} has no host copy")
        if node.lock_ref[Tier.HOST]:
            raise IndexStateError(f"{node!r} is locked in HOST")
        old, node.host = node.host, check_pages(slots, node.n_pages, "slots")
        return old

    def _clear(self, node: TreeNode, lane: int) -> np.ndarray:
        pages = self._ledger.drop_lane(node, lane)
        acc = FreedCollector()
        self._ledger.reap(node, acc)
        self._outbox.extend(acc.build())
        return pages

    def _set_lane(self, node: TreeNode, lane: int, pages: np.ndarray) -> np.ndarray:
        pages = check_pages(pages, None, "pages")
        chain = self._suffix_chain(node, len(pages))
        self._split_chain_top(chain, len(pages))
        dups: list[np.ndarray] = []
        end = len(pages)
        for x in chain:  # from `node` upwards
            start = end - len(x.keys)
            own = x.device.get(lane) if lane >= 0 else x.host
            if own is None:
                self._ledger.add_lane(x, lane, pages[start:end])
            else:
                dups.append(not_own(pages[start:end], own))
            end = start
        dups.reverse()
        return concat_pages(dups)

    def _suffix_chain(self, node: TreeNode, num_pages: int) -> list[TreeNode]:
        return suffix_chain(self._path(node), num_pages, node)

    def _split_chain_top(self, chain: list[TreeNode], num_pages: int) -> None:
        excess = sum(len(x.keys) for x in chain) - num_pages
        if excess > 0:
            self._split(chain[-1], excess)  # chain[-1] keeps its lower, covered part

    # ------------------------------------------------------------------ restore

    def restore_disk(self, records: Iterable[DiskRecord | tuple], orphans: list[bytes] | None = None) -> int:
        """Rebuild the disk part of the tree from per-page records (key, parent_key,
        tokens, last_access) in any order, merging into what is there; return the pages
        restored. Records not reachable from the salt through verified parents are
        skipped; their keys go to `orphans` when given, for the caller to delete
        (restore.py)."""
        return restore.restore_records(self, records, orphans)

    def restore_packed(self, records: restore.PackedRecords, orphans: list[bytes] | None = None) -> int:
        """restore_disk of records as arrays (the disk tier's scan), checked and chained
        in C where the index's module is built (restore.py)."""
        return restore.restore_packed(self, records, orphans)

    # ------------------------------------------------------------------ introspection

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children (a snapshot)."""
        return iter(self._preorder())

    def num_pages(self, tier: Tier, engine: int | None = None) -> int:
        """Pages resident in the tier (all engines for DEVICE when engine is None)."""
        return sum(self._ledger.resident.get(lane, 0) for lane in self._lanes_for(tier, engine))

    def protected_pages(self, tier: Tier, engine: int | None = None) -> int:
        """Resident pages locked in the tier."""
        return sum(self._ledger.protected.get(lane, 0) for lane in self._lanes_for(tier, engine))

    def evictable_pages(self, tier: Tier, engine: int | None = None) -> int:
        """Resident pages not locked in the tier (inner ones included, as in SGLang)."""
        return self.num_pages(tier, engine) - self.protected_pages(tier, engine)

    def _preorder(self) -> list[TreeNode]:
        return preorder(self.root)

    # ------------------------------------------------------------------ checks

    def _lane(self, tier: object, engine: object) -> int:
        t = check_tier(tier)
        if t is Tier.DEVICE:
            if engine is None:
                raise IndexInputError("the DEVICE tier needs an engine")
            return check_engine(engine)
        return HOST_LANE if t is Tier.HOST else DISK_LANE

    def _lanes_for(self, tier: object, engine: object) -> list[int]:
        t = check_tier(tier)
        if t is Tier.DEVICE:
            if engine is None:
                return [lane for lane in self._ledger.resident if lane >= 0]
            return [check_engine(engine)]
        return [HOST_LANE if t is Tier.HOST else DISK_LANE]

    def _path(self, node: object) -> list[TreeNode]:
        """`node` and its ancestors, root excluded; checks the node is live and ours."""
        return path_to_root(node, self.root)
