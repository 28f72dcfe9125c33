"""How long HiCacheClient waits for each call, by its place on the engine's critical path.

A daemon answers every call in well under a millisecond when it is healthy, so
a deadline only decides how much a slow or hung daemon (a CPU-starved host, SIGSTOP,
a stuck disk, a swapped-out process) costs the engine before the client gives up on
that call and answers misses / skips until the daemon answers again. The connection
stays (hicache/client/connection.py); only a daemon that answers no liveness probe
for `liveness_s` is taken for dead, and the client reconnects in the background
(hicache/client/reconnect.py).
One timeout per call kind, not one for all: a lookup blocks a request's first
token, a disk load may legitimately wait for the disk, an admin call has all the
time it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from hicache.errors import ConfigError

LIVENESS_S = 10.0


@dataclass(frozen=True, slots=True)
class CallDeadlines:
    """Seconds per call. The defaults cost a request at most a quarter second of a hung
    daemon, then nothing until it answers again."""

    connect_s: float = 0.5  # connect, hello, register: each (a stopped daemon still accepts connect())
    match_s: float = 0.25   # the lookup at the start of every request
    load_s: float = 5.0     # the disk part of a match: the daemon waits per its load policy
                            # (wait_complete: the whole read; timeout: prefetch_timeout_s), then answers
    update_s: float = 0.5   # insert, load_done, release, backup_done, state_backup_done, evict
    admin_s: float = 5.0    # stats
    # A call past its deadline is a miss, not a lost connection: its answer is handled when it
    # comes. The connection ends only when the daemon answers no liveness probe for this long.
    liveness_s: float = LIVENESS_S

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"CallDeadlines.{f.name} must be a finite number of seconds > 0, got {value!r}")

    @classmethod
    def uniform(cls, timeout_s: float) -> CallDeadlines:
        """The same deadline for every call (benchmarks and tests on loaded machines)."""
        return cls(timeout_s, timeout_s, timeout_s, timeout_s, timeout_s, max(timeout_s, LIVENESS_S))

    @classmethod
    def from_config(cls, value: object, base: CallDeadlines | None = None) -> CallDeadlines:
        """Deadlines from an engine's configuration: a number (every call) or a mapping of
        call kinds to seconds (the rest keep `base`'s, default the defaults); a clear error
        for anything else."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls.uniform(float(value))
        if not isinstance(value, dict):
            raise ConfigError(f"deadlines must be seconds or a mapping of call kinds to seconds, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown deadline(s) {unknown}; known: {sorted(known)}")
        return replace(base or cls(), **value)
