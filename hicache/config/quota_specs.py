"""Tenant quotas as configured: a tenant's minimum and maximum share of the host or disk
tier (QuotaSpec), parsed from a TOML table or a `key=value,...` string, and checked
against the tiers' capacities. The daemon enforces them in hicache/daemon/core/quotas.py;
`hicache quota` changes them at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.config.sizes import format_size, parse_size
from hicache.errors import ConfigError

QUOTA_TIERS = ("host", "disk")  # tenant quotas (hicache/daemon/core/quotas.py): the daemon's own tiers
QUOTA_KEYS = ("model", "extra_key", "namespace", "tier", "min", "max")
SALT_HEX_CHARS = 32


@dataclass(frozen=True, slots=True)
class Share:
    """A part of a tier: bytes, or a fraction of its capacity (written `25%`)."""

    nbytes: int = 0
    fraction: float | None = None

    def of(self, capacity: int) -> int:
        return int(self.fraction * capacity) if self.fraction is not None else self.nbytes

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction is not None else format_size(self.nbytes)


def parse_share(value: str | int) -> Share:
    """`25%` (of the tier's capacity), or a size: `2GiB`, `1048576`."""
    if isinstance(value, float):  # 0.25 would read as 0 bytes
        raise ConfigError(f"not a share: {value!r} (write a share of the tier as '25%', or a size)")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"not a share: {value!r} (use e.g. 25% or 2GiB)") from None
        if not 0 <= pct <= 100:
            raise ConfigError(f"a share is between 0% and 100%, got {value!r}")
        return Share(fraction=pct / 100)
    return Share(nbytes=parse_size(value))


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One tenant's guaranteed minimum and maximum share of one tier.

    The tenant is every namespace of `model`, only those with extra key `extra_key`
    when it is given, or the one namespace whose salt is `namespace` (32 hex digits)."""

    tier: str
    min: Share = Share()
    max: Share | None = None  # None: the whole tier
    model: str = ""
    extra_key: str | None = None
    namespace: str = ""

    def __post_init__(self) -> None:
        if self.tier not in QUOTA_TIERS:
            raise ConfigError(f"quota tier must be one of {QUOTA_TIERS}, got {self.tier!r}")
        if bool(self.model) == bool(self.namespace):
            raise ConfigError("a quota names its tenant by model (and optionally extra_key) or by namespace "
                              "(a salt), not both and not neither")
        if self.extra_key is not None and not self.model:
            raise ConfigError("a quota's extra_key goes with its model")
        if self.namespace and (len(self.namespace) != SALT_HEX_CHARS
                               or any(c not in "0123456789abcdef" for c in self.namespace)):
            raise ConfigError(f"a quota's namespace is a salt of {SALT_HEX_CHARS} lowercase hex digits "
                              f"(as `hicache ls --json` shows), got {self.namespace!r}")

    @property
    def tenant(self) -> tuple[str, str | None, str]:
        return (self.model, self.extra_key, self.namespace)

    def describe(self) -> str:
        if self.namespace:
            return f"namespace={self.namespace[:16]}"
        return f"model={self.model}" + ("" if self.extra_key is None else f" extra_key={self.extra_key}")

    def bounds(self, capacity: int) -> tuple[int, int]:
        """(min, max) in bytes of a tier of `capacity` bytes; ConfigError when min > max."""
        lo = self.min.of(capacity)
        hi = capacity if self.max is None else self.max.of(capacity)
        if lo > hi:
            what = f"max {self.max}" if self.max is not None else f"the tier's {format_size(capacity)}"
            raise ConfigError(f"quota {self.describe()} on {self.tier}: min {self.min} is more than {what}")
        return lo, min(hi, capacity)


def parse_quota(value: str | dict) -> QuotaSpec:
    """A quota from a TOML table or a `key=value,...` string (the flag and HICACHE_QUOTAS):
    `model=llama,extra_key=tenant-a,tier=host,min=25%,max=50%`."""
    if isinstance(value, str):
        fields: dict[str, Any] = {}
        for item in value.split(","):
            key, eq, val = item.partition("=")
            if not eq:
                raise ConfigError(f"quota {value!r}: {item!r} is not key=value")
            fields[key.strip()] = val.strip()
    elif isinstance(value, dict):
        fields = dict(value)
    else:
        raise ConfigError(f"a quota is a table or a key=value,... string, got {value!r}")
    unknown = set(fields) - set(QUOTA_KEYS)
    if unknown:
        raise ConfigError(f"quota {value!r}: unknown keys {sorted(unknown)} (known: {', '.join(QUOTA_KEYS)})")
    if "tier" not in fields:
        raise ConfigError(f"quota {value!r}: no tier (host or disk)")
    for key in ("model", "extra_key", "namespace", "tier"):
        if key in fields and not isinstance(fields[key], str):
            raise ConfigError(f"quota {value!r}: {key} must be a string")
    return QuotaSpec(tier=fields["tier"], min=parse_share(fields.get("min", 0)),
                     max=parse_share(fields["max"]) if fields.get("max") not in (None, "") else None,
                     model=fields.get("model", ""), extra_key=fields.get("extra_key"),
                     namespace=fields.get("namespace", "").lower())


def check_quotas(quotas: tuple[QuotaSpec, ...], capacities: dict[str, int | None]) -> None:
    """ConfigError unless every quota's min <= max and, per tier, the mins add up to at most its
    capacity, one quota per tenant and tier, and the tier exists (`None`: disabled)."""
    seen: set[tuple] = set()
    mins = dict.fromkeys(capacities, 0)
    for q in quotas:
        cap = capacities.get(q.tier)
        if cap is None:
            raise ConfigError(f"quota {q.describe()} on {q.tier}: this daemon has no {q.tier} tier")
        if (q.tenant, q.tier) in seen:
            raise ConfigError(f"two quotas for {q.describe()} on {q.tier}")
        seen.add((q.tenant, q.tier))
        mins[q.tier] += q.bounds(cap)[0]
    for tier, total in mins.items():
        cap = capacities[tier]
        if cap is not None and total > cap:
            raise ConfigError(f"the {tier} quotas' minimums add up to {format_size(total)}, more than the "
                              f"{tier} tier's {format_size(cap)}")
