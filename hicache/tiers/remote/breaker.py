"""The remote tier's circuit breaker rule: when a store is failing, not merely slow.

One slow answer is not a failed store. On a busy host (two CPU hogs on two cores)
a 5 ms deadline (lookups had one then) was overrun 1-5 times in 20 s while the store
was fine; a breaker that opened on each took the store out of use for ~70 ms at a
time and dropped every write in that window. So a slow answer never counts here;
only an operation that fails outright or overruns the operation timeout
(`remote_timeout_s`, 1 s) is a failure, and the breaker opens on either

- `CONSECUTIVE` failures in a row (a store that is down or hung: the remote worker
  PINGs a suspect store itself, so this needs no traffic), or
- a failure rate: at least `RATE_MIN_FAILURES` failures and at least `RATE` of the
  outcomes seen in the last `WINDOW_S` (a flapping store that answers in between).

Any success resets the consecutive count. The breaker closes when a health check
(reconnect, PING every master) succeeds; the window starts afresh then.
Pure logic, no clock of its own (callers pass `now`): tested without a store.
"""

from __future__ import annotations

from collections import deque

CONSECUTIVE = 3
WINDOW_S = 10.0
RATE = 0.5
RATE_MIN_FAILURES = 5
MAX_OUTCOMES = 256  # a bound on the window's memory; older outcomes fall out first


class Breaker:
    """Counts outcomes of store operations; `failed()` says when to open. Not thread-safe:
    the remote worker calls it under its lock."""

    def __init__(self) -> None:
        self.consecutive = 0
        self._outcomes: deque[tuple[float, bool]] = deque(maxlen=MAX_OUTCOMES)  # (time, failed)

    def succeeded(self, now: float) -> None:
        self.consecutive = 0
        self._outcomes.append((now, False))

    def failed(self, now: float) -> bool:
        """Record a failure; True when the breaker should open now."""
        self.consecutive += 1
        self._outcomes.append((now, True))
        if self.consecutive >= CONSECUTIVE:
            return True
        while self._outcomes and self._outcomes[0][0] < now - WINDOW_S:
            self._outcomes.popleft()
        failures = sum(1 for _, bad in self._outcomes if bad)
        return failures >= RATE_MIN_FAILURES and failures >= RATE * len(self._outcomes)

    def reset(self) -> None:
        """The store answered a health check: a fresh start."""
        self.consecutive = 0
        self._outcomes.clear()
