"""The client's circuit breaker, open side: reconnect in the background.

After a failed call the engine must not wait for the daemon again until it is
back: every further call answers a miss / a skip at once, and a probe thread
retries `attempt` (connect, check the peer, hello, register, each with its own
deadline) with exponential backoff. A success is parked, never used from the
probe thread: the engine thread takes it on its next call, so the arena remap
and the `on_reconnect` callbacks run on the engine thread, never racing it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from hicache.errors import DaemonUnavailable, DaemonUntrusted, HiCacheError

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closeable)


class Reconnector(Generic[T]):
    """One probe thread, from `start` until it parks a result or `close` is called."""

    def __init__(self, attempt: Callable[[], T], backoff_s: tuple[float, float], name: str = "hicache-reconnect"
                 ) -> None:
        self.attempt = attempt
        self.backoff_min_s, self.backoff_max_s = backoff_s
        self.name = name
        self.attempts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready: T | None = None
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self._ready is not None

    def start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def take(self) -> T | None:
        """The parked connection, if the probe made one (the caller owns it now)."""
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def close(self) -> None:
        """Stop probing and discard a parked connection; never waits for an attempt in flight
        (it is bounded by its own deadlines and discards its result)."""
        with self._lock:
            self._stop.set()
            ready, self._ready = self._ready, None
        if ready is not None:
            ready.close()

    def _run(self) -> None:
        backoff = self.backoff_min_s
        warned = False
        while not self._stop.is_set():
            self.attempts += 1
            try:
                ready = self.attempt()
            except HiCacheError as e:
                # an untrusted listener or a refusal is worth a warning (once per outage), an absent
                # or hung daemon is what the breaker is for
                notable = isinstance(e, DaemonUntrusted) or not isinstance(e, DaemonUnavailable)
                level = logging.WARNING if notable and not warned else logging.DEBUG
                warned |= level == logging.WARNING
                log.log(level, "hicache daemon still unavailable (%s); next try in %.2fs", e, backoff)
            except Exception:  # a bug must not kill the probe: the engine would never reconnect
                log.exception("hicache reconnect attempt failed")
            else:
                with self._lock:
                    if not self._stop.is_set():
                        self._ready = ready
                        return
                ready.close()
                return
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)
