"""Eviction over a RadixIndex: taking victims off the candidate heaps, in eviction-key
order (hint priority, then the policy's; hicache/index/policy.py), and the bulk drops
(an engine gone, a tier flushed) that report what they freed.

EvictionOps is mixed into RadixIndex (hicache/index/radix.py), which owns the tree and
its ResidencyLedger; see its docstring for eviction and Freed records."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.index.node import (
    DISK_LANE, HOST_LANE, Freed, FreedCollector, Tier, TreeNode, check_count, check_engine, check_tier,
)
from hicache.index.policy import EvictionKey, EvictionPolicy, ResidencyLedger

logger = logging.getLogger(__name__)


class EvictionOps:
    """RadixIndex's eviction (see the module docstring)."""

    if TYPE_CHECKING:  # RadixIndex's
        policy: EvictionPolicy
        clock: Callable[[], float]
        _ledger: ResidencyLedger
        _outbox: list[Freed]

        def _lane(self, tier: object, engine: object) -> int: ...

        def _preorder(self) -> list[TreeNode]: ...

    def evict(self, tier: Tier, num_pages: int, engine: int | None = None) -> list[Freed]:
        """Evict unlocked leaves of the tier (of `engine`'s device for DEVICE), lowest
        priority first, whole nodes, until >= num_pages pages are freed or none is left."""
        lane = self._lane(tier, engine)
        num_pages = check_count(num_pages)
        ledger = self._ledger
        acc = FreedCollector()
        got = 0
        now = self.clock()
        while got < num_pages:
            top = ledger.candidates.top(lane, pop=True)
            if top is None:
                break
            node = top[1]
            got += len(node.keys)
            self.policy.on_evict(node, lane, now)
            acc.add(lane, node.keys, ledger.drop_lane(node, lane))
            ledger.reap(node, acc)
        return self._drain(acc)

    def peek_evictable(self, tier: Tier, engine: int | None = None) -> EvictionKey | None:
        """Eviction key of the next victim (hint priority, policy priority), or None: lets
        a caller pick the index to evict from when namespaces share one budget."""
        cands = self._ledger.candidates
        top = cands.top(self._lane(tier, engine), pop=False)
        return None if top is None else cands.full_key(top[0])

    def refresh_order(self) -> None:
        """Re-key the eviction heaps: a hint priority in `hint_priority` went down, or the
        first one came, or the last one went."""
        self._ledger.candidates.refresh()

    def select_victims(self, tier: Tier, num_pages: int, engine: int | None = None) -> list[TreeNode]:
        """The current candidates evict() would take first (>= num_pages pages, or all),
        without evicting them: for write-back, which backs a victim up before it goes.
        Parents that would become candidates once these go are not included."""
        lane = self._lane(tier, engine)
        num_pages = check_count(num_pages)
        out: list[TreeNode] = []
        got = 0
        while got < num_pages:
            top = self._ledger.candidates.top(lane, pop=True)
            if top is None:
                break
            out.append(top[1])
            got += len(top[1].keys)
        for node in out:
            self._ledger.requeue(node, lane)
        return out

    def remove_engine(self, engine: int) -> list[Freed]:
        """The engine is gone: drop its device residency and its device locks, locked or
        not (its memory went with it). Do not unlock its device locks afterwards."""
        lane = check_engine(engine)
        acc = FreedCollector()
        if not self._ledger.resident.get(lane) and not self._ledger.protected.get(lane):
            # nothing of it anywhere (an engine that only puts, as vLLM's connector does): the
            # walk below would find nothing and cost the event loop the whole tree
            self._ledger.forget_engine([], lane, acc)
            return []
        nodes = self._preorder()
        self._ledger.forget_engine(nodes, lane, acc)
        for x in nodes:  # parents first: a removed node takes its subtree along
            if x.removed:
                continue
            if x.in_any_tier:
                for other in x.lanes():  # its locks may have dropped to zero
                    self._ledger.maybe_queue(x, other)
            else:
                self._ledger.reap(x, acc)
        freed = self._drain(acc)
        logger.info("engine %d removed: %d freed records", lane, len(freed))
        return freed

    def flush(self, tier: Tier) -> list[Freed]:
        """Drop the tier (every engine's device for DEVICE) from every node not locked in
        it; nodes left in no tier go with their subtrees. Locked nodes stay."""
        t = check_tier(tier)
        acc = FreedCollector()
        kept = dropped = 0
        for x in self._preorder():
            if x.removed:
                continue
            if t is Tier.DEVICE:
                lanes = list(x.device)
            elif t is Tier.HOST:
                lanes = [HOST_LANE] if x.host is not None else []
            else:
                lanes = [DISK_LANE] if x.on_disk else []
            for lane in lanes:
                if x.lane_locked(lane):
                    kept += len(x.keys)
                    continue
                dropped += len(x.keys)
                acc.add(lane, x.keys, self._ledger.drop_lane(x, lane))
            self._ledger.reap(x, acc)
        logger.info("flush %s: %d pages dropped, %d locked pages kept", t.name, dropped, kept)
        return self._drain(acc)

    @property
    def has_freed(self) -> bool:
        """Whether take_freed() has anything to hand over."""
        return bool(self._outbox)

    def take_freed(self) -> list[Freed]:
        """Residency released by removals outside evict/flush/remove_engine (an unlock,
        clear_*, set_disk): the caller frees it like any Freed."""
        return self._drain(None)

    def _drain(self, acc: FreedCollector | None) -> list[Freed]:
        out = self._outbox
        self._outbox = []
        if acc is not None:
            out.extend(acc.build())
        return out
