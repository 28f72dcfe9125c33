"""Locks over a RadixIndex: a ref per tier on a node and all its ancestors, so a
locked node is never evicted or removed (see radix.py's docstring, "Locks").

The loops run in C where native_index.py could be built (the index's own nodes, no
copy), else in Python through the ResidencyLedger (policy.py); both give the same
results and the same refusals.

LockOps is mixed into RadixIndex (hicache/index/radix.py), which owns the tree, its
ledger and the native loops it was given (RadixIndex.use_native)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.index.node import (
    Freed, FreedCollector, IndexInputError, IndexStateError, MatchResult, Tier, TreeNode, check_engine, check_tier,
)
from hicache.index.policy import ResidencyLedger
from hicache.index.tree_walk import check_live, path_to_root


class LockOps:
    """RadixIndex's lock and unlock (see the module docstring)."""

    if TYPE_CHECKING:  # RadixIndex's
        root: TreeNode
        _ledger: ResidencyLedger
        _outbox: list[Freed]
        _native_lock: Callable[..., None] | None
        _native_unlock: Callable[..., object] | None

        def _path(self, node: object) -> list[TreeNode]: ...


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
        locks: list[tuple[TreeNode, Tier, int | None]] = []
        if n_dev:
            locks.append((nodes[n_dev - 1], Tier.DEVICE, engine))
        if n_host:
            locks.append((nodes[n_dev + n_host - 1], Tier.HOST, None))
        return locks

    def unlock_held(self, locks: list[tuple[TreeNode, Tier, int | None]]) -> None:
        """unlock() each (node, tier, engine) of `locks`, as lock_match returns them (the
        tier a Tier, the engine an engine id or None: not checked again)."""
        for node, tier, engine in locks:
            self._unlock(node, tier, engine if tier is Tier.DEVICE else None)

    def unlock(self, node: TreeNode, tier: Tier, engine: int | None = None) -> None:
        """Drop a ref taken by lock(); below zero raises IndexStateError. A node in no
        tier whose last ref goes is removed with its subtree (see take_freed)."""
        t = check_tier(tier)
        key = None if engine is None or t is not Tier.DEVICE else check_engine(engine)
        self._unlock(node, t, key)

    def _unlock(self, node: TreeNode, t: Tier, key: int | None) -> None:
        if self._native_unlock is not None:  # the checks, the path up and the unlock in C
            doomed = self._native_unlock(node, t, key, self.root, self._ledger.protected, self._ledger.maybe_queue)
            if type(doomed) is int:
                self._refuse_unlock(node, t, key, doomed)
        else:
            path = path_to_root(node, self.root)
            held = node.device_locks.get(key, 0) if t is Tier.DEVICE else node.lock_ref[t]
            if held < 1:  # ancestors hold at least as many refs as the node
                raise IndexStateError(f"unlock below zero: {node!r} {t.name} engine={key}")
            doomed = self._ledger.unlock_path(path, t, key)
        if doomed is not None:
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
