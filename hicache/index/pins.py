"""Pinned prefixes: an application's hint to keep a prefix in a tier for a time.

A pin names a prefix of one namespace (its page keys), a tier (host or disk),
an expiry (unix seconds, so it means the same after a restart) and a priority.
It holds a lock of the index in that tier on the node ending the prefix;
RadixIndex.lock covers the node and every ancestor, and eviction takes only
unlocked candidates, so no pinned page leaves the tier before the pin goes.

What a pin covers: the leading run of the prefix the daemon stores itself (a
host copy or on disk) when it is pinned; pages only on an engine's device are
not the daemon's to keep. Pinning the same prefix again (same namespace, tier
and last page) refreshes its expiry and priority and moves the lock to what
is stored by then. A host pin on pages that are only on disk (after a restart)
keeps them on disk and holds their host copy once a request reads them back;
a disk pin on pages only on host keeps them there until written (the daemon
writes them at once).

Bounds: per namespace and tier, the pages under pins (each counted once, however
many pins share it) stay within `max_pages`; a pin that would pass it is refused
(PinBoundError) and nothing changes.

Quotas (requirement 4 of issue 29 plugs in here): `within_quota(salt, tier)`
says whether the namespace is within its share of the tier (default: always).
A pin is kept before its expiry only while it is: `enforce()` suspends, one pin
per call, the pins of a namespace over its quota -- lowest priority first, then
the one expiring soonest -- and re-applies them, highest priority first, once it
is within again. That is what priority means: which pins give way first.

Not thread-safe: the event loop that owns the indexes owns the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hicache.errors import HiCacheError
from hicache.index.node import Tier, TreeNode
from hicache.index.radix import RadixIndex

PIN_TIERS = {"host": Tier.HOST, "disk": Tier.DISK}
TIER_OF = {t: name for name, t in PIN_TIERS.items()}


class PinError(HiCacheError, ValueError):
    """A pin request is malformed; nothing changed."""


class PinBoundError(PinError):
    """The pin would take the namespace past its bound of pinned pages; nothing changed."""


class PinNotStored(PinError):
    """No page of the prefix is on host or disk: there is nothing to keep."""


@dataclass(slots=True, eq=False)
class PrefixPin:
    salt: bytes
    tier: Tier
    keys: list[bytes]          # the prefix as asked, root first (kept to re-apply it after a restart)
    expires_at: float          # unix seconds
    priority: int
    index: RadixIndex | None = None  # where `node` is locked
    node: TreeNode | None = None     # the locked node; None while suspended
    pinned: list[bytes] = field(default_factory=list)  # keys of the pages it covers, root first

    @property
    def name(self) -> tuple[bytes, Tier, bytes]:
        return self.salt, self.tier, self.keys[-1]

    @property
    def active(self) -> bool:
        return self.node is not None

    def record(self) -> dict:
        """What the pin file keeps (hicache/daemon/core/pin_file.py)."""
        return {"salt": self.salt, "tier": TIER_OF[self.tier], "keys": b"".join(self.keys),
                "expires_at": self.expires_at, "priority": self.priority}


def locate(index: RadixIndex, keys: list[bytes]) -> tuple[TreeNode, list[bytes]]:
    """The node ending the stored part of the prefix `keys`, and that part's keys.
    Keyed namespaces (SGLang's page names) find their last page by key: their
    callers may name a chain by its last pages only."""
    node, n = index.stored_prefix(keys)
    if n < len(keys) and index.key_map is not None:
        found = index.find_key(keys[-1], split=True)
        if found is not None and (found.host is not None or found.on_disk):
            node = found
    if node is index.root:
        return node, []
    path: list[list[bytes]] = []
    x: TreeNode | None = node
    while x is not None and x.keys:
        path.append(x.keys)
        x = x.parent
    return node, [k for part in reversed(path) for k in part]


class PinTable:
    def __init__(self, within_quota: Callable[[bytes, Tier], bool] | None = None) -> None:
        self.pins: dict[tuple[bytes, Tier, bytes], PrefixPin] = {}
        self.within_quota = within_quota or (lambda salt, tier: True)
        self._pages: dict[tuple[bytes, Tier], dict[bytes, int]] = {}  # pinned key -> pins covering it
        self.dirty = False  # changed since the pin file was last written
        self.counters = {"pinned": 0, "refused": 0, "expired": 0, "unpinned": 0, "suspended": 0,
                         "resumed": 0}

    # ------------------------------------------------------------------ pin / unpin

    def pin(self, index: RadixIndex, salt: bytes, tier: Tier, keys: list[bytes], expires_at: float,
            priority: int, max_pages: int) -> PrefixPin:
        """Pin the stored part of `keys` in `tier` until `expires_at`; see the module docstring."""
        if tier not in TIER_OF:
            raise PinError("a prefix is pinned to the host or the disk tier")
        if not keys:
            raise PinError("an empty prefix cannot be pinned")
        node, pinned = locate(index, keys)
        if not pinned:
            raise PinNotStored("no page of the prefix is stored on host or disk (store it first)")
        name = (salt, tier, keys[-1])
        old = self.pins.get(name)
        counts = self._pages.get((salt, tier), {})
        mine = set(old.pinned) if old is not None else set()
        others = len(counts) - sum(1 for k in mine if counts[k] == 1)  # pages other pins cover
        total = others + sum(1 for k in set(pinned) if counts.get(k, 0) - (k in mine) <= 0)
        if total > max_pages:
            self.counters["refused"] += 1
            raise PinBoundError(f"pinning {len(pinned)} pages would make {total} pinned pages in the {TIER_OF[tier]} "
                                f"tier for this namespace, over its bound of {max_pages} (pin_max_share)")
        index.lock(node, tier)  # before the old lock goes: shared pages are never unlocked in between
        if old is not None:
            self._drop(old)
        pin = PrefixPin(salt, tier, list(keys), expires_at, priority, index, node, pinned)
        self.pins[name] = pin
        self._count(pin, +1)
        self.counters["pinned"] += 1
        self.dirty = True
        return pin

    def unpin(self, salt: bytes, keys: list[bytes], tier: Tier | None = None) -> list[PrefixPin]:
        """Remove the pins of the prefix ending at keys[-1] (in `tier`, or both tiers)."""
        if not keys:
            raise PinError("an empty prefix names no pin")
        out = []
        for t in (tier,) if tier is not None else tuple(TIER_OF):
            pin = self.pins.get((salt, t, keys[-1]))
            if pin is not None:
                self._remove(pin)
                out.append(pin)
        self.counters["unpinned"] += len(out)
        return out

    def expire(self, now: float) -> list[PrefixPin]:
        """Remove the pins whose time is up; the caller reaps their namespaces."""
        gone = [p for p in self.pins.values() if p.expires_at <= now]
        for pin in gone:
            self._remove(pin)
        self.counters["expired"] += len(gone)
        return gone

    def forget(self, salt: bytes) -> None:
        """The namespace's index is gone: its pins with it (their locks went along)."""
        for pin in [p for p in self.pins.values() if p.salt == salt]:
            pin.node = None
            self._remove(pin)

    # ------------------------------------------------------------------ quotas

    def enforce(self, index_of: Callable[[bytes], RadixIndex | None]) -> list[PrefixPin]:
        """Suspend one pin of each (namespace, tier) over its quota, or resume one of
        one within it; returns the pins suspended (the caller reaps their namespaces)."""
        groups: dict[tuple[bytes, Tier], list[PrefixPin]] = {}
        for pin in self.pins.values():
            groups.setdefault((pin.salt, pin.tier), []).append(pin)
        suspended = []
        for (salt, tier), pins in groups.items():
            if not self.within_quota(salt, tier):
                active = [p for p in pins if p.active]
                if active:
                    victim = min(active, key=lambda p: (p.priority, p.expires_at))
                    self._unlock(victim)
                    suspended.append(victim)
                    self.counters["suspended"] += 1
                continue
            waiting = [p for p in pins if not p.active]
            index = index_of(salt)
            if waiting and index is not None:
                pin = max(waiting, key=lambda p: (p.priority, p.expires_at))
                node, pinned = locate(index, pin.keys)
                if pinned:
                    self._count(pin, -1)
                    index.lock(node, tier)
                    pin.index, pin.node, pin.pinned = index, node, pinned
                    self._count(pin, +1)
                    self.counters["resumed"] += 1
        return suspended

    # ------------------------------------------------------------------ introspection

    def pinned_pages(self, salt: bytes, tier: Tier) -> int:
        return len(self._pages.get((salt, tier), ()))

    def of(self, salt: bytes) -> Iterator[PrefixPin]:
        return (p for p in self.pins.values() if p.salt == salt)

    def stats(self) -> dict:
        out: dict = {name: {"pins": 0, "pages": 0, "suspended": 0} for name in PIN_TIERS}
        for pin in self.pins.values():
            t = out[TIER_OF[pin.tier]]
            t["pins"] += 1
            t["suspended"] += not pin.active
        for (_, tier), counts in self._pages.items():
            out[TIER_OF[tier]]["pages"] += len(counts)
        return {**out, **self.counters}

    # ------------------------------------------------------------------ internals

    def _remove(self, pin: PrefixPin) -> None:
        self._drop(pin)
        del self.pins[pin.name]
        self.dirty = True

    def _drop(self, pin: PrefixPin) -> None:
        self._unlock(pin)
        self._count(pin, -1)

    def _unlock(self, pin: PrefixPin) -> None:
        node, index = pin.node, pin.index
        pin.node = None
        if node is not None and index is not None and not node.removed:
            index.unlock(node, pin.tier)

    def _count(self, pin: PrefixPin, step: int) -> None:
        counts = self._pages.setdefault((pin.salt, pin.tier), {})
        for k in set(pin.pinned):
            c = counts.get(k, 0) + step
            if c > 0:
                counts[k] = c
            else:
                counts.pop(k, None)
        if not counts:
            del self._pages[(pin.salt, pin.tier)]
