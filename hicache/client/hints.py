"""Retention hints: what an application asks the cache to keep, and for how long.

A request may ask that its prefix be kept (pinned) in a tier for `ttl_s`
seconds, with a priority that orders which pins give way first when its
namespace goes over its quota (hicache/index/pins.py). Or it may give its
prefix only a priority (no `ttl_s`): its pages then leave every tier after
lower-priority pages and before higher ones, equals in the policy's order, for
the daemon's `priority_ttl_s` (hicache/index/priorities.py). An engine passes
the hint on with HiCacheClient.retain once the request's pages are stored;
vLLM requests carry it in their `kv_transfer_params` (see `from_transfer_params`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HINT_KEY = "hicache"  # the entry of vLLM's kv_transfer_params hicache reads
TIERS = ("host", "disk")


@dataclass(frozen=True, slots=True)
class RetainHint:
    ttl_s: float | None = None  # pin the prefix this long (capped at pin_max_ttl_s); None: priority only
    tier: str = "host"    # "host" or "disk": where a pin keeps it (a priority holds in every tier)
    priority: int = 0     # -1000..1000: lower gives way first (0 without ttl_s: drop the prefix's priority)

    def __post_init__(self) -> None:
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                                       or not math.isfinite(self.ttl_s) or self.ttl_s <= 0):
            raise ValueError(f"pin_ttl_s must be a positive number of seconds, got {self.ttl_s!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if type(self.priority) is not int or not -1000 <= self.priority <= 1000:
            raise ValueError(f"priority must be an int in -1000..1000, got {self.priority!r}")

    @property
    def pins(self) -> bool:
        """A pin (the `pin` call), or a priority only (`prioritize`)."""
        return self.ttl_s is not None

    def params(self) -> dict:
        if self.ttl_s is None:
            return {"priority": self.priority}
        return {"ttl_s": float(self.ttl_s), "tier": self.tier, "priority": self.priority}

    @classmethod
    def from_transfer_params(cls, params: Any) -> RetainHint | None:
        """The hint of a vLLM request, from its kv_transfer_params:
        ``{"hicache": {"pin_ttl_s": 300, "tier": "host", "priority": 0}}`` (a pin; tier and
        priority optional) or ``{"hicache": {"priority": 5}}`` (a priority only). None when
        there is none; ValueError when it is malformed."""
        if not isinstance(params, dict) or params.get(HINT_KEY) is None:
            return None
        h = params[HINT_KEY]
        if not isinstance(h, dict) or not ("pin_ttl_s" in h or "priority" in h):
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}] must be a map with 'pin_ttl_s' or 'priority'")
        unknown = set(h) - {"pin_ttl_s", "tier", "priority"}
        if unknown:
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}] has unknown entries {sorted(unknown)}")
        if "pin_ttl_s" not in h and "tier" in h:
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}]: 'tier' is a pin's (give 'pin_ttl_s')")
        if "pin_ttl_s" in h and h["pin_ttl_s"] is None:
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}]['pin_ttl_s'] must be a number of seconds")
        return cls(h.get("pin_ttl_s"), h.get("tier", "host"), h.get("priority", 0))


__all__ = ["HINT_KEY", "RetainHint"]
