"""Retention hints: what an application asks the cache to keep, and for how long.

A request may ask that its prefix be kept (pinned) in a tier for `ttl_s`
seconds, with a priority that orders which pins give way first when its
namespace goes over its quota (hicache/index/pins.py). An engine passes the
hint on with HiCacheClient.pin once the request's pages are stored; vLLM
requests carry it in their `kv_transfer_params` (see `from_transfer_params`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HINT_KEY = "hicache"  # the entry of vLLM's kv_transfer_params hicache reads
TIERS = ("host", "disk")


@dataclass(frozen=True, slots=True)
class RetainHint:
    ttl_s: float          # how long to keep the prefix (the daemon caps it at pin_max_ttl_s)
    tier: str = "host"    # "host" or "disk"
    priority: int = 0     # -1000..1000: lower gives way first

    def __post_init__(self) -> None:
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) \
                or not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
            raise ValueError(f"pin_ttl_s must be a positive number of seconds, got {self.ttl_s!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if type(self.priority) is not int or not -1000 <= self.priority <= 1000:
            raise ValueError(f"priority must be an int in -1000..1000, got {self.priority!r}")

    def params(self) -> dict:
        return {"ttl_s": float(self.ttl_s), "tier": self.tier, "priority": self.priority}

    @classmethod
    def from_transfer_params(cls, params: Any) -> RetainHint | None:
        """The hint of a vLLM request, from its kv_transfer_params:
        ``{"hicache": {"pin_ttl_s": 300, "tier": "host", "priority": 0}}`` (tier and
        priority optional). None when there is none; ValueError when it is malformed."""
        if not isinstance(params, dict) or params.get(HINT_KEY) is None:
            return None
        h = params[HINT_KEY]
        if not isinstance(h, dict) or "pin_ttl_s" not in h:
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}] must be a map with 'pin_ttl_s'")
        unknown = set(h) - {"pin_ttl_s", "tier", "priority"}
        if unknown:
            raise ValueError(f"kv_transfer_params[{HINT_KEY!r}] has unknown entries {sorted(unknown)}")
        return cls(h["pin_ttl_s"], h.get("tier", "host"), h.get("priority", 0))


__all__ = ["HINT_KEY", "RetainHint"]
