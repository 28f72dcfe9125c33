"""Fetch or recompute: a page on disk or in the remote store is loaded only when reading
it is expected to be faster than computing it again (a slow tier can cost a request more
than recomputing a short prefix).

What is known:
- The engine's prefill rate, tokens/s, from its own measurements: sent at `register`
  (`prefill_tokens_per_s`, e.g. configured) or later with `report` (the client library
  times the prefills it runs and posts the rate when it moves). Kept per engine.
- Each tier's read time, measured by its mover: the disk tier's prefetches (match to
  every page in host), the remote tier's fetches (probe answered to records verified in
  host). `TierSpeed` fits a line through the recent reads (least squares, exponentially
  weighted): seconds = latency_s + bytes / bytes_per_s. Host pages count as free.

The rule, per slow part of a match (the disk part at `match`, the remote part after its
probe): the part's n pages cover the tokens [s, s + n·ps). Computing the token at
position p costs (1 + p / context_tokens) / rate seconds -- the linear layers a constant,
attention growing with the context it reads; `context_tokens` is the context at which
attention costs as much as the rest (0: a flat cost) -- so the part takes

    recompute = n·ps / rate · (1 + (s + n·ps / 2) / context_tokens)
    fetch     = latency_s + n·page_bytes / bytes_per_s

Walking the part page by page, the time saved by loading the first k pages,
recompute(k) - fetch(k), is convex in k (a page costs the same to read wherever it is,
more to compute the deeper it is), so the best prefix of the part to load is all of it or
none: it is loaded when recompute > fetch, otherwise the match stops before it and its
pages and tokens are counted (`skipped_pages`, `skipped_tokens`, by tier).

Everything is loaded, as before this rule, when the engine reported no rate, when the tier
was never measured, and with `fetch_or_recompute = false`. A tier last measured more than
`remeasure_s` ago is read anyway (`remeasured`): one slow moment does not keep a tier
skipped for good.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache.daemon.core.records import EngineRecord

FETCH_TIERS = ("disk", "remote")
ALPHA = 0.2  # the weight of each new read against the past in a tier's fit
MIB = float(1 << 20)  # the fit works in MiB: byte counts squared would lose precision


@dataclass(slots=True)
class TierSpeed:
    """seconds = latency_s + bytes / bytes_per_s, fitted to a tier's recent reads by
    exponentially weighted least squares. Reads of one size only (no spread to fit a
    slope on) or a fit with a negative latency (noise) give a line through the origin:
    latency_s 0 and the mean rate, right for reads of the sizes seen."""

    samples: int = 0
    last_at: float = -math.inf
    _x: float = 0.0  # weighted means of MiB read, seconds, MiB², MiB·seconds
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def add(self, nbytes: int, seconds: float, now: float) -> None:
        if nbytes <= 0 or not seconds >= 0 or math.isinf(seconds):
            return
        x = nbytes / MIB
        a = 1.0 if self.samples == 0 else ALPHA
        self._x += a * (x - self._x)
        self._y += a * (seconds - self._y)
        self._xx += a * (x * x - self._xx)
        self._xy += a * (x * seconds - self._xy)
        self.samples += 1
        self.last_at = now

    def fit(self) -> tuple[float, float]:
        """(latency_s, seconds per byte); (0, 0) before the first read."""
        if not self.samples or self._x <= 0:
            return 0.0, 0.0
        var = self._xx - self._x * self._x
        cov = self._xy - self._x * self._y
        if var > (0.05 * self._x) ** 2 and cov > 0:
            slope = cov / var
            latency = self._y - slope * self._x
            if latency >= 0:
                return latency, slope / MIB
        return 0.0, self._y / self._x / MIB

    def predict_s(self, nbytes: int) -> float:
        latency, per_byte = self.fit()
        return latency + nbytes * per_byte

    def stats(self) -> dict[str, Any]:
        latency, per_byte = self.fit()
        return {"samples": self.samples, "latency_s": latency,
                "bytes_per_s": 1.0 / per_byte if per_byte > 0 else None}


@dataclass(slots=True)
class FetchCounters:
    skipped_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FETCH_TIERS, 0))
    skipped_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FETCH_TIERS, 0))
    skipped_parts: int = 0  # slow parts of matches left to be recomputed
    remeasured: int = 0  # parts read although judged slower, to measure a stale tier again


class FetchOrRecompute:
    def __init__(self, *, enabled: bool = True, context_tokens: int = 32768, remeasure_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.context_tokens = context_tokens
        self.remeasure_s = remeasure_s
        self.clock = clock
        self.speeds = {tier: TierSpeed() for tier in FETCH_TIERS}
        self.counters = FetchCounters()

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A mover read `nbytes` in `seconds` (measured even when the rule is off: `stats` shows it)."""
        self.speeds[tier].add(nbytes, seconds, self.clock())

    def recompute_s(self, rate: float, start_tokens: int, n_tokens: int) -> float:
        """Expected seconds to compute the tokens [start_tokens, start_tokens + n_tokens)."""
        scale = 1.0 + (start_tokens + n_tokens / 2) / self.context_tokens if self.context_tokens else 1.0
        return n_tokens / rate * scale

    def worth_loading(self, tier: str, engine: EngineRecord, start_pages: int, n_pages: int) -> bool:
        """Whether `engine` should load the n pages of `tier` after the first `start_pages`
        of its request; a part left to be recomputed is counted."""
        rate = engine.prefill_tokens_per_s
        speed = self.speeds[tier]
        if not self.enabled or n_pages <= 0 or rate <= 0 or not speed.samples:
            return True
        ns = engine.ns
        page_size, page_bytes = ns.index.page_size, ns.page_class.page_bytes
        n_tokens = n_pages * page_size
        if speed.predict_s(n_pages * page_bytes) < self.recompute_s(rate, start_pages * page_size, n_tokens):
            return True
        if self.clock() - speed.last_at > self.remeasure_s:
            self.counters.remeasured += 1
            return True
        c = self.counters
        c.skipped_parts += 1
        c.skipped_pages[tier] += n_pages
        c.skipped_tokens[tier] += n_tokens
        return False

    def stats(self, engines: list[EngineRecord]) -> dict[str, Any]:
        c = self.counters
        return {"enabled": self.enabled, "context_tokens": self.context_tokens, "remeasure_s": self.remeasure_s,
                "engines_with_rate": sum(1 for e in engines if e.prefill_tokens_per_s > 0),
                "tiers": {tier: s.stats() for tier, s in self.speeds.items()},
                "skipped_pages": dict(c.skipped_pages), "skipped_tokens": dict(c.skipped_tokens),
                "skipped_parts": c.skipped_parts, "remeasured": c.remeasured}
