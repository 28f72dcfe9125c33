"""RemoteWorker: the remote store's own thread and event loop, and its circuit breaker.

The daemon's event loop never talks to the store: it submits coroutines here
(`submit`) and gets a concurrent Future back. redis-py spends real CPU per
command and per reply; on a thread of its own that work never delays an RPC
behind a pipeline of hundreds of SETs. Record encoding and verification (a
copy and a checksum per page) run on a small pool (`run_cpu`), so the store's
loop stays free for the next lookup's probe.

Circuit breaker. An operation that fails outright or overruns the operation
timeout (`timeout_s`) is a failure; a slow answer within it is not
(hicache/tiers/remote/breaker.py has the rule: 3 failures in a row, or half of the
last 10 s's outcomes with at least 5 failures). A first
failure makes the store suspect: the background task PINGs it (each PING bounded
by the op timeout) until one answers, which clears the suspicion, or the failures
add up and the breaker opens. Open, `available` is False and callers skip the
store at no cost (lookups are local misses; writes wait up to
`remote_write_hold_s` for it to close, then drop, counted), while the task
reconnects and PINGs every master, with backoff (0.05 s doubling to 2 s, each try
bounded by twice the op timeout); the first success closes it. The breaker starts
open: the daemon serves at once and the remote tier joins when the store answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hicache.tiers.remote.breaker import Breaker
from hicache.tiers.remote.store import RemoteStore

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKOFF_S = (0.05, 2.0)


def is_full_store(exc: BaseException) -> bool:
    """A store out of memory under `noeviction` refuses writes; it still serves reads."""
    return str(exc).startswith("OOM")


class RemoteWorker:
    def __init__(self, store: RemoteStore, *, timeout_s: float, cpu_threads: int = 2) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.available = False  # the breaker is closed: read from any thread
        self.state = "connecting"  # connecting | up | down
        self.last_error = ""
        self.errors = 0
        self.breaker_opens = 0
        self.breaker = Breaker()
        self.down_since = time.monotonic()  # when the breaker last opened (or the worker started)
        self._lock = threading.Lock()
        self._cpu = concurrent.futures.ThreadPoolExecutor(cpu_threads, thread_name_prefix="hicache-remote-cpu")
        self._wake: asyncio.Event | None = None
        self._waiters: list[asyncio.Future] = []  # wait_up() callers, resolved when the breaker closes
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-remote", daemon=True)
        self._health: asyncio.Task | None = None
        self._closed = False
        self._thread.start()
        self._ready.wait()

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        self._health = self._loop.create_task(self._health_loop())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _health_loop(self) -> None:
        assert self._wake is not None
        delay = BACKOFF_S[0]
        while True:
            if self.available:
                if self.breaker.consecutive == 0:  # healthy: nothing to do until a failure
                    self._wake.clear()
                    await self._wake.wait()
                delay = BACKOFF_S[0]
                await asyncio.sleep(delay)  # a just-failed store gets a moment before the check
                if self.available:  # suspect, not open: does it answer at all?
                    await self._confirm()
                    continue
            try:
                await asyncio.wait_for(self._reconnect(), self.timeout_s * 2)
            except Exception as e:
                self._record_error(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_S[1])
                continue
            with self._lock:
                was, self.state, self.available = self.state, "up", True
                self.breaker.reset()
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
            if was == "down":
                log.warning("remote tier: %s answers again; the remote tier is back",
                            self.store.describe().get("url"))

    async def _confirm(self) -> None:
        """PING a suspect store on the client in use: an answer clears the suspicion."""
        try:
            await asyncio.wait_for(self.store.ping(), self.timeout_s)
        except Exception as e:
            self.failure(e)
        else:
            self.success()

    async def _reconnect(self) -> None:
        # a fresh client each time: after a failover the slots have moved, and a
        # connection whose exchange was cut holds an unknown stream position
        await self.store.connect()
        await self.store.ping()
        self.last_error = ""

    # -- callers, any thread --------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the worker's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def run_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """On the worker's loop: fn(*args) on the CPU pool."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def wait_up(self, timeout_s: float) -> bool:
        """On the worker's loop: until the breaker is closed (True) or `timeout_s` passed."""
        if self.available:
            return True
        if timeout_s <= 0:
            return False
        fut = self._loop.create_future()
        self._waiters.append(fut)  # the health task resolves it on this loop: no lost wake-up
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def down_for(self) -> float:
        """Seconds since the breaker opened; 0 while it is closed."""
        return 0.0 if self.available else time.monotonic() - self.down_since

    def success(self) -> None:
        """An operation completed in time (from any thread)."""
        with self._lock:
            self.breaker.succeeded(time.monotonic())

    def failure(self, exc: BaseException | str) -> None:
        """An operation failed or overran the op timeout (from any thread): count it; open
        the breaker when the rule (breaker.py) says so. A full store only counts."""
        if not isinstance(exc, str) and is_full_store(exc):
            with self._lock:
                self.errors += 1
                self.last_error = _describe(exc)
            return
        opened = False
        with self._lock:
            self.errors += 1
            self.last_error = exc if isinstance(exc, str) else _describe(exc)
            if self.available and self.breaker.failed(time.monotonic()):
                self.available = False
                self.state = "down"
                self.breaker_opens += 1
                self.down_since = time.monotonic()
                opened = True
        if opened:
            log.warning("remote tier: %s failed (%s, %d in a row); lookups skip it until it answers again",
                        self.store.describe().get("url"), self.last_error, self.breaker.consecutive)
        if not self._closed:
            self._loop.call_soon_threadsafe(self._wake_health)  # open: reconnect; suspect: confirm

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            first = self.state == "connecting" and not self.last_error
            self.last_error = _describe(exc)
            if self.state == "connecting" and first:
                log.warning("remote tier: cannot reach %s yet (%s); retrying in the background",
                            self.store.describe().get("url"), self.last_error)

    def _wake_health(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            if self._health is not None:
                self._health.cancel()
            try:
                await asyncio.wait_for(self.store.close(), timeout_s)
            except Exception:
                pass

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout_s + 1)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._cpu.shutdown(wait=False, cancel_futures=True)


def _describe(exc: BaseException) -> str:
    """One line naming the error; redis-py messages never carry the password."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    name = type(exc).__name__
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError)):
        return "timed out"
    return f"{name}: {text}"[:200] if text else name

