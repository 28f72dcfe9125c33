"""The engine's prefill rate, as the daemon's fetch-or-recompute rule needs it.

The daemon loads a page from disk or the remote store only when reading it is expected
to be faster than computing it again (hicache/daemon/core/fetch_or_recompute.py); how
fast the engine computes is the engine's to say. Either the user configures a rate
(tokens/s), or the engine times its prefills and this class keeps their rate: a
token-weighted moving average (the sums of tokens and of seconds, each decayed by
`ALPHA` per prefill), so a long prefill weighs more than a short one. The daemon hears
it at `register` and, as it moves by more than `REPORT_CHANGE`, through a posted
`report` call: a few calls in an engine's life, none per request. The engine's own
client bounds its waits for a lookup's disk or remote part by the same rate
(`worth_waiting_s`): waiting longer than computing the tokens would cost more.
"""

from __future__ import annotations

from hicache.rpc.protocol import MAX_PREFILL_RATE

ALPHA = 0.1
REPORT_CHANGE = 0.1  # a relative change of the rate worth telling the daemon
# How long waiting for a lookup is worth (`worth_waiting_s`): at least MIN_WAIT_S (a daemon
# answering on a loaded host), at DEFAULT_TOKENS_PER_S while the engine's rate is unknown.
MIN_WAIT_S = 0.25
DEFAULT_TOKENS_PER_S = 10_000.0


class PrefillRate:
    """`configured` (tokens/s): a fixed rate; measurements are then ignored."""

    def __init__(self, configured: float | None = None) -> None:
        if configured is not None and not 0 < configured <= MAX_PREFILL_RATE:
            raise ValueError(f"prefill_tokens_per_s must be a number in (0, {MAX_PREFILL_RATE:g}], "
                             f"got {configured!r}")
        self.configured = configured
        self._tokens = 0.0
        self._seconds = 0.0
        self._reported: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """The rate to tell the daemon; None while nothing is known."""
        if self.configured is not None:
            return self.configured
        if self._seconds <= 0:
            return None
        return min(self._tokens / self._seconds, MAX_PREFILL_RATE)

    def add(self, tokens: int, seconds: float) -> None:
        """One prefill: `tokens` computed in `seconds` (only the model's own time: a prefill
        that also waited for loads would make the engine look slower than it is)."""
        if self.configured is not None or tokens <= 0 or not 0 < seconds < float("inf"):
            return
        a = 1.0 if self._seconds <= 0 else ALPHA
        self._tokens += a * (tokens - self._tokens)
        self._seconds += a * (seconds - self._seconds)

    def worth_waiting_s(self, tokens: int) -> float:
        """How long a lookup whose answer covers `tokens` is worth waiting for: as long as
        computing them takes (never less than MIN_WAIT_S). Past it, computing is faster."""
        return max(MIN_WAIT_S, tokens / (self.tokens_per_s or DEFAULT_TOKENS_PER_S))

    def sent(self, rate: float | None) -> None:
        """The daemon was told `rate` (at register, or by `report`)."""
        self._reported = rate

    def to_report(self) -> float | None:
        """The rate, when it moved enough since the daemon last heard it; else None."""
        rate = self.tokens_per_s
        if rate is None:
            return None
        last = self._reported
        if last is not None and abs(rate - last) <= REPORT_CHANGE * last:
            return None
        return rate
