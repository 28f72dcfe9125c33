"""Keeps the cyclic garbage collector from holding the event loop for long.

CPython's full collection walks every object it tracks. The daemon's heap is
mostly its radix indexes -- about five tracked objects per tree node -- so at
100k nodes one full pass holds the loop for 0.3-0.7 s on a 2-core machine,
longer than `match`'s deadline. Yet those objects need no cycle collector: a
node lives as long as the cache keeps its pages and is freed by reference
counting when it goes (nothing points back at a removed node). So the daemon
runs the collector itself (`managed_gc`, on by default):

- young collections (generations 0 and 1) run as CPython schedules them: they
  see only new objects, and most short-lived garbage dies there;
- CPython never starts a full collection itself (its generation-2 threshold is
  set out of reach);
- a *pass* every `interval_s` collects whatever is not frozen -- only objects
  that survived since the last pass -- then freezes the survivors
  (`gc.freeze`), so a pass costs what the heap grew by since the last one,
  not the heap. The interval adapts so a pass stays near `target_pass_s`;
- frozen objects are not scanned again. A cycle that dies after being frozen
  would stay, so a *full pass* (unfreeze, collect everything, freeze: the
  whole heap, 0.1-0.7 s) runs only when no request at all has arrived for
  `idle_s` (a minute), at most every `full_interval_s` (an hour); `stats()`
  reports what full passes found, which is how to see whether anything
  long-lived dies in cycles (measured: nothing, over thousands of puts and
  hundreds of connections opened and closed).

`stats()` goes into `hicache stats` under "gc". It costs nothing that grows with
the heap: CPython counts the frozen objects by walking them (`gc.get_freeze_count`,
~60-130 ms at a million pages), so the count is taken where the heap is walked anyway
(start-up, full passes) and reported with its age.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_NEVER = 1 << 30  # a generation-2 threshold CPython never reaches


class GcSteward:
    def __init__(self, requests: Callable[[], int], *, interval_s: float = 0.5,
                 target_pass_s: float = 0.002, idle_s: float = 60.0, full_interval_s: float = 3600.0) -> None:
        self.requests = requests  # the server's request count: unchanged means idle
        self._seen_requests = -1
        self._quiet_since = time.monotonic()
        self.interval_s = interval_s
        # A pass over nothing new costs ~40 us; one over a second of fast index growth ~10 ms.
        self.min_interval_s, self.max_interval_s = 0.1, 1.0
        self.target_pass_s = target_pass_s
        self.idle_s = idle_s
        self.full_interval_s = full_interval_s
        self.passes = 0
        self.max_pass_s = 0.0
        self.last_pass_s = 0.0
        self.startup_pass_s = 0.0  # before the daemon serves: no request waits on it
        self.full_passes = 0
        self.max_full_pass_s = 0.0
        self.full_pass_found = 0  # unreachable objects full passes found among frozen ones
        self._last_full = time.monotonic()
        self._saved_threshold: tuple[int, int, int] | None = None
        self.frozen_objects = 0  # as counted at start-up or the last full pass (see the module doc)
        self.frozen_counted_at = 0.0  # monotonic

    def start(self) -> None:
        """After start-up: everything built so far (the rebuilt index included) is frozen."""
        self._saved_threshold = gc.get_threshold()
        t0, t1, _ = self._saved_threshold
        gc.set_threshold(t0, t1, _NEVER)
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.startup_pass_s = time.perf_counter() - t
        self._count_frozen()
        log.info("garbage collector managed: %d objects frozen after start-up", self.frozen_objects)

    def _count_frozen(self) -> None:
        """O(frozen objects): only where the whole heap is walked anyway."""
        self.frozen_objects, self.frozen_counted_at = gc.get_freeze_count(), time.monotonic()

    def stop(self) -> None:
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            gc.unfreeze()
            self._saved_threshold = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            seen = self.requests()
            if seen != self._seen_requests:
                self._seen_requests, self._quiet_since = seen, now
            if now - self._quiet_since >= self.idle_s and now - self._last_full >= self.full_interval_s:
                self._full_pass()
            else:
                self._pass()
                self._adapt()

    def _pass(self) -> None:
        t = time.perf_counter()
        gc.collect()  # frozen objects are not scanned: this sees what survived since the last pass
        gc.freeze()
        self.last_pass_s = time.perf_counter() - t
        self.max_pass_s = max(self.max_pass_s, self.last_pass_s)
        self.passes += 1

    def _adapt(self) -> None:
        """Passes near the target: shorter intervals when the heap grows fast."""
        if self.last_pass_s > self.target_pass_s:
            self.interval_s = max(self.min_interval_s, self.interval_s / 2)
        elif self.last_pass_s < self.target_pass_s / 4:
            self.interval_s = min(self.max_interval_s, self.interval_s * 1.5)

    def _full_pass(self) -> None:
        t = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self._count_frozen()
        took = time.perf_counter() - t
        self._last_full = time.monotonic()
        self.full_passes += 1
        self.full_pass_found += found
        self.max_full_pass_s = max(self.max_full_pass_s, took)
        if found:
            log.info("idle full garbage collection: %d unreachable objects in %.0f ms", found, took * 1e3)

    def stats(self) -> dict:
        return {"managed": True, "frozen_objects": self.frozen_objects,
                "frozen_counted_s_ago": round(time.monotonic() - self.frozen_counted_at, 1),
                "startup_pass_ms": round(self.startup_pass_s * 1e3, 3), "passes": self.passes,
                "interval_s": round(self.interval_s, 3), "last_pass_ms": round(self.last_pass_s * 1e3, 3),
                "max_pass_ms": round(self.max_pass_s * 1e3, 3), "full_passes": self.full_passes,
                "max_full_pass_ms": round(self.max_full_pass_s * 1e3, 3),
                "full_pass_found": self.full_pass_found}
