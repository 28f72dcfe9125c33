"""Tenant quotas: a guaranteed minimum and a maximum share of the host and disk tiers.

A *tenant* is what a quota names (config.QuotaSpec): every namespace of a model
(all its TP ranks, layouts and extra keys), those of a model with one extra key
(the client's tenant salt), or one namespace by its salt. A namespace belongs,
per tier, to the most specific quota naming it (salt, then model and extra
key, then model); a namespace no quota names is a tenant of its own with no
minimum and no maximum. Usage is counted in page bytes: a namespace's host
pages (its slots in use, reserved ones included) and its disk pages (committed
and being written).

The rules, applied when a tenant's page needs room:
- at or above its maximum a tenant cannot grow: its own lowest-priority pages
  go to make room for its new ones (none can go: the new page is not stored);
- when the tier is full, victims come from the tenants above their minimum,
  those above their maximum first, then the one most over its minimum (in
  bytes); a tenant gives pages only down to its minimum, never below;
- nothing is reserved: a tenant below its minimum leaves the rest free for
  others (lent), and takes it back from them (they are over their minimum)
  when it stores again.

Without a quota on a tier none of this runs there: namespaces share it by the
eviction policy alone (CacheService.alloc_host, DiskMover._make_room). With one,
the engine cycle and the disk mover call `alloc_host` and `make_disk_room` here.
Victims are taken one index node at a time, so a tenant above its minimum is
never taken below it. `within_quota` is the cheap question the pins ask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.config import QuotaSpec, check_quotas
from hicache.daemon.core.records import NamespaceState
from hicache.daemon.core.slab_reclaim import reclaim_slab
from hicache.index.node import Tier

if TYPE_CHECKING:
    from hicache.daemon.core.service import CacheService

log = logging.getLogger(__name__)

TIERS = {"host": Tier.HOST, "disk": Tier.DISK}
MAX_STEPS = 256  # room-making rounds per allocation; each frees a node or a slab


@dataclass(slots=True, eq=False)
class Quota:
    spec: QuotaSpec
    min_bytes: int
    max_bytes: int

    def matches(self, ns: NamespaceState) -> bool:
        s = self.spec
        if s.namespace:
            return ns.salt.hex() == s.namespace
        n = ns.namespace
        return n.model == s.model and (s.extra_key is None or n.extra_key == s.extra_key)

    @property
    def rank(self) -> int:
        """Specificity: a salt names one namespace, an extra key fewer than a model."""
        return 2 if self.spec.namespace else 1 if self.spec.extra_key is not None else 0


@dataclass(slots=True, eq=False)
class _Group:
    """The namespaces of one tenant in one tier, and their usage."""

    quota: Quota | None
    members: list[NamespaceState] = field(default_factory=list)
    used_bytes: int = 0

    @property
    def min_bytes(self) -> int:
        return self.quota.min_bytes if self.quota is not None else 0

    def max_bytes(self, capacity: int) -> int:
        return self.quota.max_bytes if self.quota is not None else capacity


class TenantQuotas:
    """The quota table of a daemon and the victim choice it implies."""

    def __init__(self, service: CacheService, capacities: dict[str, int | None]) -> None:
        self.service = service
        self.capacities = capacities  # tier -> bytes (None: the tier is off)
        self.quotas: dict[str, list[Quota]] = {tier: [] for tier in TIERS}
        self._of: dict[tuple[str, bytes], Quota | None] = {}  # (tier, salt) -> its quota
        # The disk mover reports the bytes of a namespace's writes in flight (its pages
        # count from when they are queued, as the disk budget counts them).
        self.disk_inflight: Callable[[NamespaceState], int] = lambda ns: 0
        self.throttled_pages = {tier: 0 for tier in TIERS}  # evicted to keep a tenant under its max
        self.refused_pages = {tier: 0 for tier in TIERS}  # not stored: no room within the rules

    @property
    def active(self) -> bool:
        return any(self.quotas.values())

    def applies(self, tier: str) -> bool:
        """Whether any quota names `tier`: without one, the tier is shared by the policy alone."""
        return bool(self.quotas[tier])

    # -- the table ---------------------------------------------------------------------
    def replace_all(self, specs: Iterable[QuotaSpec]) -> None:
        """Install `specs` as the whole table (the config's), all checked first."""
        self.quotas = self._checked(tuple(specs))
        self._of.clear()

    def set(self, spec: QuotaSpec) -> Quota:
        """Add or replace the quota of spec's tenant on spec's tier; ConfigError (nothing
        changed) when the table would break a rule."""
        specs = [q.spec for t in TIERS for q in self.quotas[t]
                 if not (q.spec.tier == spec.tier and q.spec.tenant == spec.tenant)]
        table = self._checked((*specs, spec))
        self.quotas = table
        self._of.clear()
        log.info("quota %s on %s: min %s, max %s", spec.describe(), spec.tier, spec.min, spec.max or "the tier")
        return next(q for q in table[spec.tier] if q.spec is spec)

    def clear(self, tenant: tuple[str, str | None, str], tier: str | None) -> int:
        """Drop the tenant's quotas (of one tier, or both); how many were dropped."""
        n = 0
        for t in TIERS if tier is None else (tier,):
            keep = [q for q in self.quotas[t] if q.spec.tenant != tenant]
            n += len(self.quotas[t]) - len(keep)
            self.quotas[t] = keep
        self._of.clear()
        return n

    def _checked(self, specs: tuple[QuotaSpec, ...]) -> dict[str, list[Quota]]:
        check_quotas(specs, self.capacities)
        table: dict[str, list[Quota]] = {tier: [] for tier in TIERS}
        for spec in specs:
            lo, hi = spec.bounds(self.capacities[spec.tier])  # type: ignore[arg-type]
            table[spec.tier].append(Quota(spec, lo, hi))
        return table

    def quota_of(self, ns: NamespaceState, tier: str) -> Quota | None:
        key = (tier, ns.salt)
        if key in self._of:
            return self._of[key]
        if len(self._of) > 4 * len(self.service.namespaces) + 64:  # forgotten namespaces' entries
            self._of.clear()
        found = [q for q in self.quotas[tier] if q.matches(ns)]
        quota = max(found, key=lambda q: q.rank) if found else None
        self._of[key] = quota
        return quota

    # -- accounting --------------------------------------------------------------------
    def ns_bytes(self, ns: NamespaceState, tier: str) -> int:
        if tier == "host":
            return ns.page_class.used_pages * ns.page_class.page_bytes
        return ns.index.num_pages(Tier.DISK) * ns.page_class.page_bytes + self.disk_inflight(ns)

    def _groups(self, tier: str) -> list[_Group]:
        groups: dict[int, _Group] = {}
        for ns in self.service.namespaces.values():
            quota = self.quota_of(ns, tier)
            g = groups.get(id(quota) if quota is not None else id(ns))
            if g is None:
                g = groups[id(quota) if quota is not None else id(ns)] = _Group(quota)
            g.members.append(ns)
            g.used_bytes += self.ns_bytes(ns, tier)
        return list(groups.values())

    def _group_of(self, ns: NamespaceState, tier: str) -> _Group:
        quota = self.quota_of(ns, tier)
        if quota is None:
            return _Group(None, [ns], self.ns_bytes(ns, tier))
        g = _Group(quota)
        for other in self.service.namespaces.values():
            if self.quota_of(other, tier) is quota:
                g.members.append(other)
                g.used_bytes += self.ns_bytes(other, tier)
        if ns not in g.members:  # not registered yet (a rebuild, an import)
            g.members.append(ns)
            g.used_bytes += self.ns_bytes(ns, tier)
        return g

    def within_quota(self, ns: NamespaceState, tier: Tier | str) -> bool:
        """Whether ns's tenant is at or under its maximum share of `tier` (always, without
        a quota): the pins of a tenant within its quota are not evicted before their TTL."""
        name = tier if isinstance(tier, str) else {Tier.HOST: "host", Tier.DISK: "disk"}.get(tier)
        if name not in TIERS or not self.quotas[name]:
            return True
        quota = self.quota_of(ns, name)
        return quota is None or self._group_of(ns, name).used_bytes <= quota.max_bytes

    def rows(self) -> list[dict]:
        """Usage against min and max per quota, and per tier the namespaces no quota names."""
        out = []
        for tier in TIERS:
            cap = self.capacities.get(tier)
            if cap is None or not self.quotas[tier]:
                continue
            groups = self._groups(tier)
            others = [g for g in groups if g.quota is None]
            by_quota = {id(g.quota): g for g in groups if g.quota is not None}
            for q in self.quotas[tier]:
                g = by_quota.get(id(q)) or _Group(q)
                out.append({"tier": tier, "tenant": q.spec.describe(), "model": q.spec.model,
                            "extra_key": q.spec.extra_key, "namespace": q.spec.namespace or None,
                            "namespaces": [ns.salt.hex() for ns in g.members], "used_bytes": g.used_bytes,
                            "min": str(q.spec.min), "max": str(q.spec.max) if q.spec.max is not None else None,
                            "min_bytes": q.min_bytes, "max_bytes": q.max_bytes, "capacity_bytes": cap,
                            "within_quota": g.used_bytes <= q.max_bytes})
            out.append({"tier": tier, "tenant": "(no quota)", "model": None, "extra_key": None, "namespace": None,
                        "namespaces": [ns.salt.hex() for g in others for ns in g.members],
                        "used_bytes": sum(g.used_bytes for g in others), "min": None, "max": None,
                        "min_bytes": 0, "max_bytes": cap, "capacity_bytes": cap, "within_quota": True})
        return out

    def stats(self) -> dict:
        return {"rows": self.rows(), "throttled_pages": dict(self.throttled_pages),
                "refused_pages": dict(self.refused_pages)}

    # -- victims -----------------------------------------------------------------------
    def _victims(self, tier: str) -> list[tuple[NamespaceState, int]]:
        """(namespace, pages it may lose) in the order victims are taken: the tenants above
        their maximum first (the most over it first), then the rest above their minimum,
        the most over it first; within a tenant, the namespace with the lowest-priority page."""
        cap = self.capacities[tier] or 0
        ranked = []
        for g in self._groups(tier):
            over_min = g.used_bytes - g.min_bytes
            if over_min <= 0:
                continue  # at or below its minimum: never a victim
            over_max = g.used_bytes - g.max_bytes(cap)
            ranked.append(((over_max > 0, over_max if over_max > 0 else over_min), g, over_min))
        ranked.sort(key=lambda r: r[0], reverse=True)
        out = []
        t = TIERS[tier]
        for _, g, over_min in ranked:
            members = [(ns.index.peek_evictable(t), ns) for ns in g.members]
            for _prio, ns in sorted((m for m in members if m[0] is not None), key=lambda m: m[0]):
                out.append((ns, over_min // ns.page_class.page_bytes))
        return out

    def _evict_within(self, ns: NamespaceState, tier: str, want_pages: int, budget_pages: int | None) -> int:
        """Evict about want_pages of ns's lowest-priority pages of `tier`, whole index nodes,
        never more than budget_pages (None: no bound); the pages evicted."""
        svc, t = self.service, TIERS[tier]
        count = ((lambda: ns.page_class.used_pages) if tier == "host"
                 else (lambda: ns.index.num_pages(Tier.DISK)))
        evict = svc.evict_host if tier == "host" else svc.evict_disk
        before = count()
        if budget_pages is None:
            evict(ns, want_pages)
            return before - count()
        done = 0
        while done < want_pages:
            top = ns.index.select_victims(t, 1)
            if not top or done + top[0].n_pages > budget_pages:
                break
            if not evict(ns, 1):
                break
            done = before - count()
        return done

    def _shrink_to_max(self, ns: NamespaceState, tier: str, nbytes: int) -> bool:
        """A tenant that would pass its maximum with nbytes more loses its own pages first;
        False when they cannot go (locked) and it cannot grow."""
        quota = self.quota_of(ns, tier)
        if quota is None or quota.max_bytes >= (self.capacities[tier] or 0):
            return True
        for _ in range(MAX_STEPS):
            g = self._group_of(ns, tier)
            excess = g.used_bytes + nbytes - quota.max_bytes
            if excess <= 0:
                return True
            members = [(m.index.peek_evictable(TIERS[tier]), m) for m in g.members]
            members = [m for m in members if m[0] is not None]
            if not members:
                return False
            victim = min(members, key=lambda m: m[0])[1]
            want = -(-excess // victim.page_class.page_bytes)
            got = self._evict_within(victim, tier, want, None)
            if not got:
                return False
            self.throttled_pages[tier] += got
        return False

    # -- host --------------------------------------------------------------------------
    def alloc_host(self, ns: NamespaceState, n_pages: int) -> np.ndarray | None:
        """CacheService.alloc_host under quotas: n host pages of ns's own slabs, or None."""
        cls = ns.page_class
        if not self._shrink_to_max(ns, "host", n_pages * cls.page_bytes):
            self.refused_pages["host"] += n_pages
            return None
        for _ in range(MAX_STEPS):
            pages = cls.alloc(n_pages)
            if pages is not None:
                return pages
            if not self._host_room(ns, n_pages):
                break
        self.refused_pages["host"] += n_pages
        return None

    def _host_room(self, ns: NamespaceState, n_pages: int) -> bool:
        """One step toward n free pages for ns when no slab is free: its own pages go, or a
        slab of the first victim that can give one (slab_reclaim.py); False: none can."""
        svc, cls = self.service, ns.page_class
        for victim, budget in self._victims("host"):
            if victim is ns:
                if self._evict_within(ns, "host", max(1, n_pages - cls.available()), budget):
                    return True
                continue
            left = [budget]

            def bounded(v: NamespaceState, k: int, left: list[int] = left) -> bool:
                got = self._evict_within(v, "host", k, left[0])
                left[0] -= got
                return got > 0

            if reclaim_slab(svc.host, victim, bounded, svc.counters):
                return True
        return False

    # -- disk --------------------------------------------------------------------------
    def make_disk_room(self, ns: NamespaceState, nbytes: int, free_bytes: Callable[[], int]) -> bool:
        """DiskMover._make_room under quotas: room for nbytes more of ns on disk, where
        free_bytes() is what the disk budget has left; False: the page is not written."""
        if not self._shrink_to_max(ns, "disk", nbytes):
            self.refused_pages["disk"] += -(-nbytes // ns.page_class.page_bytes)
            return False
        for _ in range(MAX_STEPS):
            short = nbytes - free_bytes()
            if short <= 0:
                return True
            for victim, budget in self._victims("disk"):
                want = -(-short // victim.page_class.page_bytes)
                if self._evict_within(victim, "disk", want, budget):
                    break
            else:
                break
        self.refused_pages["disk"] += -(-nbytes // ns.page_class.page_bytes)
        return False
