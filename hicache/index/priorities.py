"""Prefix priorities: an application's hint on which pages should leave last.

A priority names a prefix of one namespace (its page keys), an int in
-1000..1000 and an expiry (unix seconds). It covers the pages of the prefix the
daemon stores itself when it is set (as a pin does, hicache/index/pins.py) and
orders eviction in every tier those pages are in: a page's *hint priority* is
the highest of the priorities covering it (0 for none), and eviction takes the
lowest hint priority first, the tier's policy ordering equals (policy.py's
eviction key). A priority never makes a page unevictable: a tenant over its
quota still gives its pages up, lowest first; only a pin locks.

Hint priorities live in the index by page key (`RadixIndex.hint_priority`):
page keys survive node splits and removals, and a covered page stored again
while the priority lasts gets it back. A prefix covers whole nodes (it ends at
a node boundary, and ancestors are covered with it), so a node's first page
speaks for it.

Bounds, so that one tenant cannot make its whole share outlast everyone else's:
- a priority expires (the caller caps the TTL), and
- per namespace, the pages under a positive hint priority (each counted once)
  stay within `max_pages`; a priority that would pass it is refused
  (PriorityBoundError) and nothing changes. Negative priorities are not
  bounded: they only make the namespace's own pages leave sooner.

Setting a prefix's priority again replaces it (and its expiry); priority 0
removes it. Not thread-safe: the event loop that owns the indexes owns the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hicache.index.pins import PinBoundError, PinError, PinNotStored, locate
from hicache.index.radix import RadixIndex

MAX_PRIORITY = 1000  # priorities are -1000..1000


class PriorityBoundError(PinBoundError):
    """The priority would take the namespace past its bound of prioritized pages; nothing changed."""


@dataclass(slots=True, eq=False)
class PrefixPriority:
    salt: bytes
    keys: list[bytes]     # the prefix as asked, root first
    priority: int
    expires_at: float     # unix seconds
    index: RadixIndex
    pages: list[bytes]    # keys of the pages it covers, root first


class PriorityTable:
    def __init__(self) -> None:
        self.entries: dict[tuple[bytes, bytes], PrefixPriority] = {}
        self._refs: dict[bytes, dict[bytes, dict[int, int]]] = {}  # salt -> page -> priority -> entries
        self._positive: dict[bytes, int] = {}  # salt -> pages under a positive hint priority
        self.counters = {"set": 0, "refused": 0, "expired": 0, "removed": 0}

    def set(self, index: RadixIndex, salt: bytes, keys: list[bytes], priority: int, expires_at: float,
            max_pages: int) -> PrefixPriority | None:
        """Give the stored part of `keys` `priority` until `expires_at` (0: remove it);
        the entry, or None when removed. PinError and nothing changed when refused."""
        if type(priority) is not int or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise PinError(f"priority must be an int in -{MAX_PRIORITY}..{MAX_PRIORITY}")
        if not keys:
            raise PinError("an empty prefix takes no priority")
        name = (salt, keys[-1])
        old = self.entries.get(name)
        if priority == 0:
            if old is not None:
                self._remove(old)
                self.counters["removed"] += 1
            return None
        _, pages = locate(index, keys)
        if not pages:
            raise PinNotStored("no page of the prefix is stored on host or disk (store it first)")
        entry = PrefixPriority(salt, list(keys), priority, expires_at, index, pages)
        hints = index.hint_priority
        first = not hints  # the heaps hold the policy's priority alone until now
        touched = pages if old is None else [*old.pages, *pages]
        before = {k: hints.get(k, 0) for k in touched}
        if old is not None:
            self._apply(old, -1)
        self._apply(entry, +1)
        if priority > 0 and self._positive.get(salt, 0) > max_pages:
            total = self._positive.get(salt, 0)
            self._apply(entry, -1)
            if old is not None:
                self._apply(old, +1)
            self.counters["refused"] += 1
            raise PriorityBoundError(f"a priority on {len(pages)} pages would make {total} prioritized pages in "
                                     f"this namespace, over its bound of {max_pages} (priority_max_share)")
        self.entries[name] = entry
        self.counters["set"] += 1
        if first or any(hints.get(k, 0) < b for k, b in before.items()):
            index.refresh_order()
        return entry

    def expire(self, now: float) -> int:
        """Remove the priorities whose time is up; how many went."""
        gone = [e for e in self.entries.values() if e.expires_at <= now]
        for entry in gone:
            self._remove(entry)
        self.counters["expired"] += len(gone)
        return len(gone)

    def forget(self, salt: bytes) -> None:
        """The namespace's index is gone: its priorities with it."""
        for entry in [e for e in self.entries.values() if e.salt == salt]:
            del self.entries[(salt, entry.keys[-1])]
        self._refs.pop(salt, None)
        self._positive.pop(salt, None)

    # ------------------------------------------------------------------ introspection

    def prioritized_pages(self, salt: bytes) -> int:
        return self._positive.get(salt, 0)

    def of(self, salt: bytes) -> Iterator[PrefixPriority]:
        return (e for e in self.entries.values() if e.salt == salt)

    def stats(self) -> dict:
        return {"prefixes": len(self.entries), "pages": sum(len(r) for r in self._refs.values()),
                "positive_pages": sum(self._positive.values()), **self.counters}

    # ------------------------------------------------------------------ internals

    def _remove(self, entry: PrefixPriority) -> None:
        del self.entries[(entry.salt, entry.keys[-1])]
        # lowered, or the index's last hint went (its heaps go back to the policy's keys)
        if self._apply(entry, -1) or not entry.index.hint_priority:
            entry.index.refresh_order()

    def _apply(self, entry: PrefixPriority, step: int) -> bool:
        """Add (step 1) or take back (-1) the entry's cover; whether a hint priority went down."""
        refs = self._refs.setdefault(entry.salt, {})
        hints = entry.index.hint_priority
        positive = self._positive.get(entry.salt, 0)
        lowered = False
        p = entry.priority
        for k in dict.fromkeys(entry.pages):
            counts = refs.setdefault(k, {})
            c = counts.get(p, 0) + step
            if c > 0:
                counts[p] = c
            else:
                counts.pop(p, None)
            before = hints.get(k, 0)
            after = max(counts) if counts else 0
            if not counts:
                del refs[k]
            if after:
                hints[k] = after
            else:
                hints.pop(k, None)
            positive += (after > 0) - (before > 0)
            lowered |= after < before
        if not refs:
            del self._refs[entry.salt]
        if positive:
            self._positive[entry.salt] = positive
        else:
            self._positive.pop(entry.salt, None)
        return lowered
