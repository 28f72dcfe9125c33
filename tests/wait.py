"""Waiting in tests: on a condition, against a deadline, never for a fixed time (CI is loaded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition",
               interval_s: float = 0.01) -> T:
    """Poll `cond` until it returns something truthy (returned); TimeoutError after `timeout_s`.
    The timeout is a hang guard sized for a loaded machine, not a timing check."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = cond()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not hold within {timeout_s:g}s")
        time.sleep(interval_s)


async def events_until_quiet(sub: Any, quiet_s: float = 2.0) -> list[dict]:
    """Every event a subscription delivers until none comes for `quiet_s` (the traffic that
    raises them has ended), then the subscription is closed."""
    events: list[dict] = []
    try:
        while True:
            events.append(await asyncio.wait_for(sub.next_event(), quiet_s))
    except asyncio.TimeoutError:
        pass
    await sub.close()
    return events
