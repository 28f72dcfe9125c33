"""Where pages go when a tier needs room: the engine cycle's eviction side.

TierEviction is mixed into CacheService (service.py). alloc_host is the shared host
budget the ingest protocol draws on (growing a namespace into another's slab when the
arena is full: slab_reclaim.py; under tenant quotas, quotas.py chooses); evict_host
and evict_disk drop a namespace's lowest-priority pages; flush and evict_tier are the
admin calls (in steps, so the RPC handler lets the loop run between them); and
_apply_freed returns what the index freed to its owners: host slots to their page
class, disk keys to the disk tier, device pages to their engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.records import TIER_NAMES, Counters, EngineRecord, NamespaceState
from hicache.daemon.core.slab_reclaim import reclaim_slab
from hicache.index.node import Freed, Tier


class TierEviction:
    """CacheService's eviction side (see the module docstring)."""

    if TYPE_CHECKING:  # CacheService's (service.py says what each is)
        host: HostTier
        namespaces: dict[bytes, NamespaceState]
        engines: dict[int, EngineRecord]
        counters: Counters
        emit: Callable[[dict], None]
        quotas: Any
        hybrid: Any
        before_host_evict: Callable[[NamespaceState, int], None] | None
        on_disk_freed: Callable[[NamespaceState, list[bytes]], None] | None

    # -- the host budget and a namespace's evictions ---------------------------
    def alloc_host(self, ns: NamespaceState, n_pages: int) -> np.ndarray | None:
        """n host pages of ns's own slabs. When the arena is full the oldest host pages
        anywhere make room: ns's own LRU leaves, or a whole slab taken from the
        namespace that holds them (slab_reclaim.py). Under tenant quotas their rules
        choose instead (quotas.py)."""
        if self.quotas is not None and self.quotas.applies("host"):
            return self.quotas.alloc_host(ns, n_pages)
        cls = ns.page_class
        pages = cls.alloc(n_pages)
        while pages is None:
            victim = self._oldest_host_namespace()
            if victim is not None and victim is not ns and reclaim_slab(self.host, victim, self.evict_host, self.counters):
                pages = cls.alloc(n_pages)
                continue
            # no slab to be had: only our own pages can go
            if ns.index.peek_evictable(Tier.HOST) is None or not self.evict_host(ns, n_pages - cls.available()):
                return None
            pages = cls.alloc(n_pages)
        return pages

    def evict_host(self, ns: NamespaceState, n_pages: int) -> bool:
        """Drop about n_pages of ns's least recently used host pages (the disk tier demotes
        those it lacks first); False when none can go."""
        if self.before_host_evict is not None:
            self.before_host_evict(ns, n_pages)
        freed = ns.index.evict(Tier.HOST, n_pages)
        if not freed:
            return False
        self._apply_freed(ns, freed, None)
        return True

    def evict_disk(self, ns: NamespaceState, n_pages: int) -> bool:
        """Drop about n_pages of ns's lowest-priority disk pages; False when none can go."""
        freed = ns.index.evict(Tier.DISK, n_pages)
        if not freed:
            return False
        self._apply_freed(ns, freed, None)
        return True

    def _oldest_host_namespace(self) -> NamespaceState | None:
        best, best_prio = None, None
        for ns in self.namespaces.values():
            prio = ns.index.peek_evictable(Tier.HOST)
            if prio is not None and (best_prio is None or prio < best_prio):
                best, best_prio = ns, prio
        return best

    def _apply_freed(self, ns: NamespaceState, freed: list[Freed], requester: EngineRecord | None
                     ) -> list[np.ndarray]:
        """Return slots to their owners; gives back the requester's device pages to free."""
        mine: list[np.ndarray] = []
        disk_keys: list[bytes] = []
        for f in freed:
            tier = TIER_NAMES[f.tier]
            self.counters.evicted_pages[tier] += len(f.keys)
            self.emit({"type": "removed", "tier": tier, "engine": f.engine, "namespace": ns.salt.hex(),
                       "keys": f.keys})
            if f.tier is Tier.HOST and f.slots is not None:
                ns.page_class.free(f.slots)
            elif f.tier is Tier.DISK:
                disk_keys.extend(f.keys)
            elif f.tier is Tier.DEVICE and f.slots is not None:
                if requester is not None and f.engine == requester.engine_id:
                    mine.append(f.slots)
                elif f.engine in self.engines:
                    self.engines[f.engine].reclaim.append(f.slots)
        if disk_keys and self.on_disk_freed is not None:
            self.on_disk_freed(ns, disk_keys)
        if self.hybrid is not None:  # removed nodes may have carried state checkpoints
            self.hybrid.reap(ns)
        return mine

    # -- admin --------------------------------------------------------------
    def flush(self, tier: Tier) -> int:
        n = 0
        for n in self.flush_steps(tier):
            pass
        return n

    def flush_steps(self, tier: Tier) -> Iterator[int]:
        """flush, one namespace per step (the RPC handler lets the loop run between steps);
        yields the pages dropped so far."""
        n = 0
        for ns in list(self.namespaces.values()):
            freed = ns.index.flush(tier)
            n += sum(len(f.keys) for f in freed if f.tier is tier)
            self._apply_freed(ns, freed, None)
            yield n

    def evict_tier(self, tier: Tier, num_bytes: int) -> int:
        """Admin eviction of about num_bytes from host or disk, oldest namespace first."""
        done = 0
        for done in self.evict_tier_steps(tier, num_bytes):
            pass
        return done

    def evict_tier_steps(self, tier: Tier, num_bytes: int, step_pages: int | None = None) -> Iterator[int]:
        """evict_tier in steps of at most step_pages pages; yields the bytes evicted so far."""
        done = 0
        while done < num_bytes:
            cands = [(ns.index.peek_evictable(tier), ns) for ns in self.namespaces.values()]
            cands = [(p, ns) for p, ns in cands if p is not None]
            if not cands:
                break
            _, ns = min(cands, key=lambda c: c[0])
            page_bytes = ns.namespace.layout.page_bytes
            want = max(1, -(-(num_bytes - done) // page_bytes))
            if step_pages is not None:
                want = min(want, step_pages)
            if tier is Tier.HOST and self.before_host_evict is not None:
                self.before_host_evict(ns, want)
            freed = ns.index.evict(tier, want)
            if not freed:
                break
            done += sum(len(f.keys) for f in freed if f.tier is tier) * page_bytes
            self._apply_freed(ns, freed, None)
            yield done
