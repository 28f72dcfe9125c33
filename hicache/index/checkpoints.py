"""Hybrid-model state checkpoints in the radix index (seeds/000 section 5, seeds/003).

A hybrid model (Mamba / linear-attention layers beside attention layers) can
reuse a cached prefix only up to a position where its recurrent state was
saved: the KV of the attention layers can be cut anywhere, the state cannot.
So a request's *usable prefix* is the position of the deepest checkpoint on
its matched path, never beyond the KV match (SGLang's `best_value_len`).

Where checkpoints live
- At node ends: a checkpoint at position p hangs on the node whose path ends
  at p (`node.state`), splitting a node at p when needed. A split keeps the
  lower half's identity, so a checkpoint stays at its position forever.
- Only at multiples of `chunk_size` tokens (a multiple of the page size).
- Per tier: a host state slot (`host_slot`) and/or a copy on disk (`on_disk`,
  under `disk_key`, derived from the node's last page key). A checkpoint in
  neither is gone: the node becomes a *tombstone* (KV kept, state gone), and
  matching walks past it to a shallower checkpoint.

Eviction: per tier, checkpoints have their own LRU (insertion-ordered dicts,
touched on match and store), independent of the KV's; locked checkpoints (a
request copying one, a disk read in flight) are skipped. When the KV node under
a checkpoint is removed from the tree, the checkpoint goes with it:
`take_removed()` hands it to the owner, who frees its host slot and disk copy.

What gets stored when a request is cached (the rule of seeds/003):
- if the request's match ended on a node boundary, its checkpoint at the last
  chunk-aligned position of its sequence;
- if its match ended inside a node (the tree forks mid-node there), the
  checkpoint at the fork's last chunk-aligned position -- the request passed
  through it during prefill, and it is the one later requests share.
`positions_to_store` turns the checkpoints an engine offers into the ones to
keep: offers at or before that target. An engine with chunked prefill may
offer one per chunk; all of those before the target are kept too.

Not thread-safe: the event loop that owns the RadixIndex owns this.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hicache.index.keys import KEY_BYTES
from hicache.index.node import IndexInputError, IndexStateError, Tier, TreeNode, check_engine, check_keys
from hicache.index.radix import RadixIndex
from hicache.index.tree_walk import common_pages  # the match walk's key search

logger = logging.getLogger(__name__)

STATE_TIERS = (Tier.HOST, Tier.DISK)


def checkpoint_disk_key(end_page_key: bytes) -> bytes:
    """The disk key of the checkpoint at the end of page `end_page_key` (distinct from any page key)."""
    return hashlib.blake2b(end_page_key, digest_size=KEY_BYTES, person=b"hicache-ckpt").digest()


@dataclass(slots=True, eq=False)
class Checkpoint:
    """The recurrent state after the first `position` tokens of `node`'s path."""

    node: TreeNode
    position: int
    disk_key: bytes
    host_slot: int | None = None
    on_disk: bool = False
    locks: int = 0
    last_access: float = 0.0
    removed: bool = False  # tombstoned or its node went away; the owner frees what it held

    @property
    def resident(self) -> bool:
        return self.host_slot is not None or self.on_disk

    def __repr__(self) -> str:
        tiers = "+".join(t for t, on in (("host", self.host_slot is not None), ("disk", self.on_disk)) if on)
        return f"Checkpoint(@{self.position}, {tiers or 'gone'}, locks={self.locks})"


@dataclass(slots=True)
class StateProbe:
    """What the tree holds for a request, read before match or insert splits anything."""

    kv_pages: int                   # pages RadixIndex.match(keys, engine) returns
    checkpoint: Checkpoint | None   # the deepest resident checkpoint within them
    fork_tokens: int | None         # tokens shared with the tree, when the request leaves it inside a node

    @property
    def usable_tokens(self) -> int:
        return 0 if self.checkpoint is None else self.checkpoint.position


@dataclass(slots=True)
class EvictedState:
    """A tier's copy of a checkpoint that eviction dropped; the owner frees the slot or disk key."""

    checkpoint: Checkpoint
    tier: Tier
    host_slot: int | None  # for HOST
    tombstone: bool        # the checkpoint is gone from every tier now


class CheckpointIndex:
    """State checkpoints of one namespace's radix tree: rules, residency, LRU."""

    def __init__(self, index: RadixIndex, chunk_size: int, clock: Callable[[], float] | None = None) -> None:
        if type(chunk_size) is not int or chunk_size <= 0 or chunk_size % index.page_size:
            raise IndexInputError(f"chunk_size must be a positive multiple of the page size "
                                  f"{index.page_size}, got {chunk_size!r}")
        self.index = index
        self.chunk_size = chunk_size
        self.clock = clock if clock is not None else index.clock
        # Per tier, checkpoints from least to most recently used.
        self._lru: dict[Tier, OrderedDict[Checkpoint, None]] = {t: OrderedDict() for t in STATE_TIERS}
        self._removed: list[Checkpoint] = []
        self._parked: list[Checkpoint] = []  # removed while locked: freed at their last unlock

    # ------------------------------------------------------------------ rules

    def aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.chunk_size

    def probe(self, keys: list[bytes], engine: int | None = None) -> StateProbe:
        """Walk `keys` as RadixIndex.match(keys, engine) would, without splitting or
        touching: how many pages it will match, the deepest resident checkpoint
        inside them, and whether the request leaves the tree inside a node."""
        keys = check_keys(keys)
        lane = None if engine is None else check_engine(engine)
        ps = self.index.page_size
        node, i, n = self.index.root, 0, len(keys)
        seg = 0 if lane is not None else 1  # the match's segments: device, host, disk
        best: Checkpoint | None = None
        fork: int | None = None
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            if seg == 0 and lane in child.device:
                pass
            elif seg <= 1 and child.host is not None:
                seg = 1
            elif child.on_disk or child.host is not None:
                seg = 2
            else:
                break
            j = common_pages(child.keys, keys, i)
            i += j
            if j < len(child.keys):
                fork = i * ps
                break
            ck = child.state
            if ck is not None and ck.resident:
                best = ck
            node = child
        return StateProbe(i, best, fork)

    def store_target(self, seq_tokens: int, fork_tokens: int | None) -> int:
        """Where the rule wants this request's checkpoint (0: nowhere)."""
        return self.aligned(seq_tokens if fork_tokens is None else min(fork_tokens, seq_tokens))

    def positions_to_store(self, offered: Iterable[int], seq_tokens: int, fork_tokens: int | None) -> list[int]:
        """The offered checkpoint positions to keep, ascending: chunk-aligned, inside the
        sequence's full pages, at or before the rule's target."""
        target = self.store_target(seq_tokens, fork_tokens)
        return sorted({p for p in offered if 0 < p <= target and p % self.chunk_size == 0})

    # ------------------------------------------------------------------ residency

    def node_for(self, keys: list[bytes], position: int) -> TreeNode | None:
        """The node a checkpoint at `position` of the sequence `keys` hangs on (split
        out if `position` is inside a node); None when that prefix is not in the tree."""
        ps = self.index.page_size
        if position <= 0 or position % self.chunk_size or position > len(keys) * ps:
            raise IndexInputError(f"checkpoint position {position} is not a chunk boundary inside the sequence")
        return self.index.node_ending_at(keys[:position // ps])

    def put(self, node: TreeNode, *, host_slot: int | None = None, on_disk: bool = False
            ) -> tuple[Checkpoint, int | None]:
        """Record a copy of the checkpoint at `node`'s end in host slot `host_slot` and/or
        on disk. Returns the checkpoint and the given host slot if it was not adopted
        (a host copy was there already): the caller frees it."""
        if host_slot is None and not on_disk:
            raise IndexInputError("a checkpoint needs a host slot or a disk copy")
        if host_slot is not None and (type(host_slot) is not int or host_slot < 0):
            raise IndexInputError(f"host_slot must be an int >= 0, got {host_slot!r}")
        position = self._end_position(node)
        if position % self.chunk_size:
            raise IndexInputError(f"a checkpoint at {position} is not at a multiple of {self.chunk_size}")
        ck = node.state
        if not isinstance(ck, Checkpoint):
            ck = Checkpoint(node, position, checkpoint_disk_key(node.keys[-1]))
            node.state = ck
        spare = None
        if host_slot is not None:
            if ck.host_slot is None:
                ck.host_slot = host_slot
                self._lru[Tier.HOST][ck] = None
            else:
                spare = host_slot
        if on_disk and not ck.on_disk:
            ck.on_disk = True
            self._lru[Tier.DISK][ck] = None
        self.touch(ck)
        return ck, spare

    def drop(self, ck: Checkpoint, tier: Tier) -> EvictedState | None:
        """Forget the tier's copy (a disk copy found missing or corrupt, an admin flush);
        None if it had none. A locked checkpoint's host copy cannot be dropped (a request
        may be copying it): IndexStateError. Its disk copy can: a lost copy is lost."""
        self._check_tier(tier)
        if ck.removed or not self._has(ck, tier):
            return None
        if ck.locks and tier is Tier.HOST:
            raise IndexStateError(f"{ck!r} is locked")
        return self._drop(ck, tier)

    def _drop(self, ck: Checkpoint, tier: Tier) -> EvictedState:
        del self._lru[tier][ck]
        slot = None
        if tier is Tier.HOST:
            slot, ck.host_slot = ck.host_slot, None
        else:
            ck.on_disk = False
        gone = not ck.resident
        if gone:  # tombstone: the KV stays, the state is gone
            ck.node.state = None
            ck.removed = True
        return EvictedState(ck, tier, slot, gone)

    # ------------------------------------------------------------------ use

    def touch(self, ck: Checkpoint) -> None:
        ck.last_access = self.clock()
        for tier in STATE_TIERS:
            lru = self._lru[tier]
            if ck in lru:
                lru.move_to_end(ck)

    def lock(self, ck: Checkpoint) -> None:
        if ck.removed:
            raise IndexStateError(f"{ck!r} was removed")
        ck.locks += 1

    def unlock(self, ck: Checkpoint) -> None:
        if ck.locks < 1:
            raise IndexStateError(f"unlock below zero: {ck!r}")
        ck.locks -= 1
        if not ck.locks and ck in self._parked:
            self._parked.remove(ck)
            self._removed.append(ck)

    # ------------------------------------------------------------------ eviction

    def evict(self, tier: Tier, count: int) -> list[EvictedState]:
        """Drop the tier's copy of up to `count` checkpoints, least recently used first,
        skipping locked ones. A checkpoint left in no tier becomes a tombstone."""
        self._check_tier(tier)
        victims = []
        for ck in self._lru[tier]:
            if len(victims) >= count:
                break
            if not ck.locks:
                victims.append(ck)
        return [self._drop(ck, tier) for ck in victims]

    def next_victim(self, tier: Tier) -> Checkpoint | None:
        """The checkpoint evict(tier, 1) would take, or None."""
        self._check_tier(tier)
        for ck in self._lru[tier]:
            if not ck.locks:
                return ck
        return None

    def peek_evictable(self, tier: Tier) -> float | None:
        """last_access of the next victim in the tier, or None: picks the namespace to
        evict from when several share one budget."""
        ck = self.next_victim(tier)
        return None if ck is None else ck.last_access

    def take_removed(self) -> list[Checkpoint]:
        """Checkpoints whose KV node left the tree since the last call, with their host
        slot and disk flag still set: the caller frees them. A locked one is handed
        over at its last unlock instead (a request may still be copying it)."""
        for ck in self.index.take_removed_states():
            if not isinstance(ck, Checkpoint) or ck.removed:
                continue
            ck.removed = True
            for tier in STATE_TIERS:
                self._lru[tier].pop(ck, None)
            (self._parked if ck.locks else self._removed).append(ck)
        out, self._removed = self._removed, []
        return out

    # ------------------------------------------------------------------ introspection

    def count(self, tier: Tier) -> int:
        self._check_tier(tier)
        return len(self._lru[tier])

    def checkpoints(self, tier: Tier) -> list[Checkpoint]:
        """The tier's checkpoints, least recently used first (a snapshot)."""
        self._check_tier(tier)
        return list(self._lru[tier])

    # ------------------------------------------------------------------ helpers

    def _has(self, ck: Checkpoint, tier: Tier) -> bool:
        return ck.host_slot is not None if tier is Tier.HOST else ck.on_disk

    @staticmethod
    def _check_tier(tier: object) -> None:
        if tier not in STATE_TIERS:
            raise IndexInputError(f"checkpoints live in HOST or DISK, not {tier!r}")

    def _end_position(self, node: object) -> int:
        if not isinstance(node, TreeNode) or node.is_root:
            raise IndexInputError("expected a non-root TreeNode")
        if node.removed:
            raise IndexStateError(f"{node!r} was removed from the index")
        pages = 0
        x = node
        while x.parent is not None:
            pages += x.n_pages
            x = x.parent
        if x is not self.index.root:
            raise IndexStateError(f"{node!r} belongs to another index")
        return pages * self.index.page_size
