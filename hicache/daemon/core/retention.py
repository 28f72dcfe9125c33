"""Retention: the daemon's pinned and prioritized prefixes -- bounds, expiry, quotas, persistence.

The table of pins and what a pin does to the index are hicache/index/pins.py;
this class ties it to the daemon: which namespace's index a pin locks, the
bound of pinned pages per namespace and tier (`pin_max_share` of the tier's
capacity, in that namespace's pages), freeing what an unlock leaves in no tier
(CacheService.reap), writing a disk pin's pages at once (the disk mover's
`write_pinned`), the once-a-second sweep (expiry, quotas, the pins file) and
the restore at startup. Prefix priorities (hicache/index/priorities.py) are
bounded here too (`priority_max_share` of the host tier, in the namespace's
pages), expire in the same sweep, and live in memory only: a restart drops them
(an application renews a priority with each request that carries it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hicache.daemon.core.pin_file import PinFile
from hicache.daemon.core.records import NamespaceState
from hicache.daemon.core.service import CacheService
from hicache.index.keys import KEY_BYTES
from hicache.index.node import Tier, TreeNode
from hicache.index.pins import PIN_TIERS, TIER_OF, PinError, PinTable, PrefixPin
from hicache.index.priorities import PrefixPriority, PriorityTable

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # expiry, quota checks and the pins file, this often


class Retention:
    def __init__(self, service: CacheService, *, host_capacity: int, disk_capacity: int, max_share: float,
                 max_ttl_s: float, pin_file: PinFile | None = None,
                 within_quota: Callable[[bytes, Tier], bool] | None = None,
                 priority_max_share: float = 0.25, priority_ttl_s: float = 600.0) -> None:
        self.service = service
        self.capacity = {Tier.HOST: host_capacity, Tier.DISK: disk_capacity}
        self.max_share = max_share
        self.max_ttl_s = max_ttl_s
        self.file = pin_file
        self.table = PinTable(within_quota)
        self.priorities = PriorityTable()
        self.priority_max_share = priority_max_share
        self.priority_ttl_s = priority_ttl_s
        self.write_pinned: Callable[[NamespaceState, TreeNode], None] | None = None  # the disk mover's
        self.restored = 0
        self.dropped_at_restore = 0

    def max_pages(self, ns: NamespaceState, tier: Tier) -> int:
        return int(self.capacity[tier] * self.max_share) // ns.namespace.layout.page_bytes

    # ------------------------------------------------------------------ pin / unpin

    def pin(self, ns: NamespaceState, tier: Tier, keys: list[bytes], ttl_s: float, priority: int) -> PrefixPin:
        if not self.capacity[tier]:
            raise PinError(f"this daemon has no {TIER_OF[tier]} tier to pin to")
        if not 0 < ttl_s <= self.max_ttl_s:
            raise PinError(f"ttl_s must be in (0, {self.max_ttl_s:g}] (pin_max_ttl_s)")
        pin = self.table.pin(ns.index, ns.salt, tier, keys, time.time() + ttl_s, priority,
                             self.max_pages(ns, tier))
        self.service.reap(ns)  # a replaced pin's unlock may free what is in no tier
        if tier is Tier.DISK and self.write_pinned is not None and pin.node is not None:
            self.write_pinned(ns, pin.node)
        return pin

    def unpin(self, ns: NamespaceState, keys: list[bytes], tier: Tier | None) -> int:
        gone = self.table.unpin(ns.salt, keys, tier)
        self.service.reap(ns)
        return len(gone)

    # ------------------------------------------------------------------ priorities

    def max_priority_pages(self, ns: NamespaceState) -> int:
        return int(self.capacity[Tier.HOST] * self.priority_max_share) // ns.namespace.layout.page_bytes

    def prioritize(self, ns: NamespaceState, keys: list[bytes], priority: int,
                   ttl_s: float | None) -> PrefixPriority | None:
        """Order the eviction of the prefix's stored pages by `priority` for `ttl_s` (the
        default priority_ttl_s when None); priority 0 removes it (None returned)."""
        ttl = self.priority_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.max_ttl_s:
            raise PinError(f"ttl_s must be in (0, {self.max_ttl_s:g}] (pin_max_ttl_s)")
        return self.priorities.set(ns.index, ns.salt, keys, priority, time.time() + ttl,
                                   self.max_priority_pages(ns))

    # ------------------------------------------------------------------ the sweep

    def sweep_once(self, now: float | None = None) -> None:
        svc = self.service
        for salt in {p.salt for p in self.table.pins.values()}:  # namespaces forgotten under their pins
            ns = svc.namespaces.get(salt)
            if ns is None or any(p.index is not None and p.index is not ns.index for p in self.table.of(salt)):
                self.table.forget(salt)
        for salt in {e.salt for e in self.priorities.entries.values()}:
            ns = svc.namespaces.get(salt)
            if ns is None or any(e.index is not ns.index for e in self.priorities.of(salt)):
                self.priorities.forget(salt)
        now = time.time() if now is None else now
        self.priorities.expire(now)
        touched = {p.salt for p in self.table.expire(now)}

        def index_of(salt: bytes) -> Any:
            ns = svc.namespaces.get(salt)
            return None if ns is None else ns.index

        touched |= {p.salt for p in self.table.enforce(index_of)}
        for salt in touched:
            ns = svc.namespaces.get(salt)
            if ns is not None:
                svc.reap(ns)
        self.save()

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep_once()
            except Exception:  # a sweep must not stop: pins would never expire
                log.exception("pin sweep failed")

    def save(self, force: bool = False) -> None:
        if self.file is None or not (self.table.dirty or force):
            return
        if self.file.save([p.record() for p in self.table.pins.values()]):
            self.table.dirty = False

    def restore(self) -> None:
        """Apply the pins of the pins file again (after the disk tier rebuilt the index)."""
        if self.file is None:
            return
        now = time.time()
        for rec in self.file.load():
            try:
                salt, keys, tier = rec["salt"], rec["keys"], PIN_TIERS[rec["tier"]]
                expires_at, priority = float(rec["expires_at"]), int(rec["priority"])
                ns = self.service.namespaces.get(salt) if isinstance(salt, bytes) else None
                if expires_at <= now or ns is None or not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
                    raise PinError("expired, or its namespace is not on disk")
                split = [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
                self.table.pin(ns.index, salt, tier, split, expires_at, priority, self.max_pages(ns, tier))
                self.restored += 1
            except (PinError, KeyError, TypeError, ValueError):
                self.dropped_at_restore += 1
        self.table.dirty = self.dropped_at_restore > 0
        if self.restored or self.dropped_at_restore:
            log.info("pins: %d restored, %d dropped (expired, or their pages are gone)", self.restored,
                     self.dropped_at_restore)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        return {**self.table.stats(), "restored": self.restored, "dropped_at_restore": self.dropped_at_restore}

    def priority_stats(self) -> dict:
        return self.priorities.stats()

    def listing(self, salt: bytes) -> list[dict]:
        """The namespace's pins, as `hicache ls` shows them."""
        return [{"key": p.keys[-1].hex(), "tier": TIER_OF[p.tier], "pages": len(p.pinned),
                 "expires_at": p.expires_at, "priority": p.priority, "active": p.active}
                for p in sorted(self.table.of(salt), key=lambda p: p.expires_at)]

    def priority_listing(self, salt: bytes) -> list[dict]:
        """The namespace's prefix priorities, as `hicache ls` shows them."""
        return [{"key": e.keys[-1].hex(), "pages": len(e.pages), "priority": e.priority,
                 "expires_at": e.expires_at}
                for e in sorted(self.priorities.of(salt), key=lambda e: (-e.priority, e.expires_at))]
