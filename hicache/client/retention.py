"""Retention hints (hicache/client/hints.py) sent for a prefix: pin it in a tier for a
while, order its eviction by a priority, or drop its pins.

RetentionCalls is mixed into HiCacheClient (hicache/client/client.py), whose `_report`
sends each call through the circuit breaker: a daemon that is away, or refuses (logged),
answers None (0 for unpin)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.client.hints import RetainHint


class RetentionCalls:
    """HiCacheClient's retention calls (see the module docstring)."""

    if TYPE_CHECKING:  # HiCacheClient's
        engine_id: int | None

        def _report(self, method: str, params: dict, *, wait: bool = True) -> dict | None: ...

        def page_keys(self, tokens: Any) -> list[bytes]: ...

    def pin(self, hint: RetainHint, tokens: Any = None, *, keys: list[bytes] | None = None,
            wait: bool = True) -> dict | None:
        """Keep the stored part of a prefix in `hint.tier` for `hint.ttl_s` seconds. Returns
        the daemon's answer (pages pinned, expiry), None when the daemon is away, refused
        (not stored, over the namespace's bound; logged) or with `wait=False`."""
        if not hint.pins:
            raise ValueError("a hint without ttl_s is a priority only: send it with prioritize() or retain()")
        if keys is None:
            keys = self.page_keys(tokens)
        if not keys:
            return None
        params = {"engine": self.engine_id, "keys": b"".join(keys), **hint.params()}
        r = self._report("pin", params, wait=wait)
        return r if wait else None

    def prioritize(self, hint: RetainHint, tokens: Any = None, *, keys: list[bytes] | None = None,
                   wait: bool = True) -> dict | None:
        """Order the eviction of the stored part of a prefix by `hint.priority` (0: back to
        the policy's order) for the daemon's priority_ttl_s. Returns the daemon's answer
        (pages, expiry), None when away, refused (logged) or with `wait=False`."""
        if keys is None:
            keys = self.page_keys(tokens)
        if not keys:
            return None
        params = {"engine": self.engine_id, "keys": b"".join(keys), "priority": hint.priority}
        r = self._report("prioritize", params, wait=wait)
        return r if wait else None

    def retain(self, hint: RetainHint, tokens: Any = None, *, keys: list[bytes] | None = None,
               wait: bool = True) -> dict | None:
        """What `hint` asks: a pin (it has a ttl_s) or a priority only."""
        call = self.pin if hint.pins else self.prioritize
        return call(hint, tokens, keys=keys, wait=wait)

    def unpin(self, tokens: Any = None, *, keys: list[bytes] | None = None, tier: str | None = None) -> int:
        """Drop the pins of the prefix (in `tier`, or both); how many went (0 when away)."""
        if keys is None:
            keys = self.page_keys(tokens)
        params: dict[str, Any] = {"engine": self.engine_id, "keys": b"".join(keys)}
        if tier is not None:
            params["tier"] = tier
        if not keys:
            return 0
        r = self._report("unpin", params)
        return 0 if r is None else int(r["removed"])
