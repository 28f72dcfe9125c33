"""Locks over a RadixIndex: a ref per tier on a node and all its ancestors, so a
locked node is never evicted or removed (see radix.py's docstring, "Locks").

The loops run in C where native_index.py could be built (the index's own nodes, no
copy), else in Python through the ResidencyLedger (policy.py); both give the same
results and the same refusals. match_locked is a request's match and its locks as one
step (one C call where no node needs splitting): the service's match takes it.

LockOps is mixed into RadixIndex (hicache/index/radix.py), which owns the tree, its
ledger and the native loops it was given (RadixIndex.use_native)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hicache.index.keys import PackedKeys
from hicache.index.node import (
    Freed, FreedCollector, IndexInputError, IndexStateError, MatchResult, Tier, TreeNode, check_engine, check_tier,
    segment_pages,
)
from hicache.index.policy import ResidencyLedger
from hicache.index.tree_walk import check_live, path_to_root


def held_locks(nodes: list[TreeNode], n_dev: int, n_host: int,
               engine: int) -> list[tuple[TreeNode, Tier, int | None]]:
    """A match's locks as unlock_held takes them: the device segment's last node on the
    engine's device, the host segment's last node in HOST (each lock covers the path up)."""
    locks: list[tuple[TreeNode, Tier, int | None]] = []
    if n_dev:
        locks.append((nodes[n_dev - 1], Tier.DEVICE, engine))
    if n_host:
        locks.append((nodes[n_dev + n_host - 1], Tier.HOST, None))
    return locks


class LockOps:
    """RadixIndex's lock and unlock (see the module docstring)."""

    if TYPE_CHECKING:  # RadixIndex's
        root: TreeNode
        _ledger: ResidencyLedger
        _outbox: list[Freed]
        _native_lock: Callable[..., None] | None
        _native_unlock: Callable[..., object] | None
        _native_walk_lock: Callable[..., tuple[list[TreeNode], int, int, int]] | None
        clock: Callable[[], float]

        def _path(self, node: object) -> list[TreeNode]: ...
        def _split_walked(self, path: list[TreeNode], j: int, now: float) -> None: ...
        def match(self, keys: list[bytes], engine: int | None = None) -> MatchResult: ...


    def lock(self, node: TreeNode, tier: Tier, engine: int | None = None) -> None:
        """Add a ref in `tier` on `node` and its ancestors. For DEVICE, `engine` names
        whose copy is protected; None protects every engine's copy."""
        t = check_tier(tier)
        key = None if engine is None or t is not Tier.DEVICE else check_engine(engine)
        self._ledger.lock_path(self._path(node), t, key)

    def lock_match(self, result: MatchResult, engine: int) -> list[tuple[TreeNode, Tier, int | None]]:
        """The locks a request takes on what match(keys, engine) just returned (nothing
        changed since): `engine`'s device segment on its device, the device and host
        segments in HOST (the host copies the engine loads from). Returns them as
        (node, tier, engine) for unlock_held; one check and no walk back up per lock."""
        nodes = result.nodes
        n_dev, n_host = len(result.device_nodes), len(result.host_nodes)
        if not (n_dev or n_host):
            return []
        if nodes[0].parent is not self.root or nodes[n_dev + n_host - 1].removed:
            raise IndexStateError("the match result is not of this index's current tree")
        if n_dev:
            check_engine(engine)
        if self._native_lock is not None:
            self._native_lock(nodes, n_dev, n_host, engine, self._ledger.protected)
        else:
            if n_dev:
                self._ledger.lock_path(nodes[:n_dev], Tier.DEVICE, engine)
            if n_host:
                self._ledger.lock_path(nodes[:n_dev + n_host], Tier.HOST, None)
        return held_locks(nodes, n_dev, n_host, engine)

    def match_locked(self, keys: list[bytes], engine: int
                     ) -> tuple[list[TreeNode], int, int, np.ndarray, np.ndarray, list[tuple[TreeNode, Tier, int | None]]]:
        """match(keys, engine), then lock_match on its result, as one step: (nodes, n_dev,
        n_host, device_pages, host_pages, locks). `nodes` is the matched path, its first
        n_dev nodes the device segment, the next n_host the host segment, the rest the disk
        segment; the page arrays and locks are the MatchResult's and lock_match's.

        Why: every engine request waits on match + lock. With the C loops and keys off the
        wire this is one native call (walk and locks) and no result object; where the walk
        stopped inside a node, the node is split here first and locked after, as match
        and lock_match do. The same state changes either way (tests/index/test_native_index.py)."""
        if type(engine) is not int or engine < 0:
            engine = check_engine(engine)
        walk = self._native_walk_lock
        if walk is None or type(keys) is not PackedKeys:
            r = self.match(keys, engine)
            return (r.nodes, len(r.device_nodes), len(r.host_nodes), r.device_pages, r.host_pages,
                    self.lock_match(r, engine))
        now = self.clock()
        path, n_dev, n_host, j = walk(self.root, keys.blob, engine, now, self._ledger.protected)
        if j >= 0:  # diverged or ended inside the last node: split (as match), then lock
            self._split_walked(path, j, now)
            if n_dev or n_host:
                self._native_lock(path, n_dev, n_host, engine, self._ledger.protected)
        device_pages, host_pages = segment_pages(path, n_dev, n_host, engine)
        return path, n_dev, n_host, device_pages, host_pages, held_locks(path, n_dev, n_host, engine)

    def unlock_held(self, locks: list[tuple[TreeNode, Tier, int | None]]) -> bool:
        """unlock() each (node, tier, engine) of `locks`, as lock_match returns them (the
        tier a Tier, the engine an engine id or None: not checked again). Returns whether
        Freed records wait for take_freed (has_freed), so a caller asks no second time."""
        unlock = self._native_unlock
        if unlock is None:
            for node, tier, engine in locks:
                self._unlock(node, tier, engine if tier is Tier.DEVICE else None)
            return bool(self._outbox)
        root, ledger = self.root, self._ledger  # _unlock's native branch, inlined: one frame per release
        for node, tier, engine in locks:
            key = engine if tier is Tier.DEVICE else None
            doomed = unlock(node, tier, key, root, ledger.protected, ledger.maybe_queue)
            if doomed is not None:
                self._unlocked(node, tier, key, doomed)
        return bool(self._outbox)

    def unlock(self, node: TreeNode, tier: Tier, engine: int | None = None) -> None:
        """Drop a ref taken by lock(); below zero raises IndexStateError. A node in no
        tier whose last ref goes is removed with its subtree (see take_freed)."""
        t = check_tier(tier)
        key = None if engine is None or t is not Tier.DEVICE else check_engine(engine)
        self._unlock(node, t, key)

    def _unlock(self, node: TreeNode, t: Tier, key: int | None) -> None:
        if self._native_unlock is not None:  # the checks, the path up and the unlock in C
            doomed = self._native_unlock(node, t, key, self.root, self._ledger.protected, self._ledger.maybe_queue)
        else:
            path = path_to_root(node, self.root)
            held = node.device_locks.get(key, 0) if t is Tier.DEVICE else node.lock_ref[t]
            if held < 1:  # ancestors hold at least as many refs as the node
                raise IndexStateError(f"unlock below zero: {node!r} {t.name} engine={key}")
            doomed = self._ledger.unlock_path(path, t, key)
        if doomed is not None:
            self._unlocked(node, t, key, doomed)

    def _unlocked(self, node: TreeNode, t: Tier, key: int | None, doomed: object) -> None:
        """After an unlock: remove the subtree it left in no tier, or raise native
        unlock_node's refusal (an int code; nothing changed)."""
        if type(doomed) is int:
            self._refuse_unlock(node, t, key, doomed)
        acc = FreedCollector()
        self._ledger.remove_subtree(doomed, acc)
        self._outbox.extend(acc.build())

    @staticmethod
    def _refuse_unlock(node: object, t: Tier, key: int | None, code: int) -> None:
        """The error of native_index.unlock_node's refusal `code` (nothing changed)."""
        if code == 1:
            check_live(node)
            raise IndexInputError("expected a non-root TreeNode")
        if code == 2:
            raise IndexStateError(f"{node!r} belongs to another index")
        raise IndexStateError(f"unlock below zero: {node!r} {t.name} engine={key}")
