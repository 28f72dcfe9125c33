"""Waiting in tests: on a condition, against a deadline, never for a fixed time (CI is loaded)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
