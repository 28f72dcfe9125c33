"""Progress lines for long CLI operations (export, import, bench runs).

Shown only when stderr is a terminal: a pipe, a log file or a test's captured stderr
gets nothing, so scripted output stays exactly what it was. One line, redrawn in place
at most `interval_s` apart, ended with a newline when the operation finishes.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from hicache.config import format_size


class Progress:
    """`done` of `total` units (pages, requests, bytes) of one named operation."""

    def __init__(self, label: str, total: int | None = None, unit: str = "", stream: TextIO | None = None,
                 interval_s: float = 0.1, as_bytes: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream)
        self.label = label
        self.total = total
        self.unit = unit
        self.as_bytes = as_bytes
        self.interval_s = interval_s
        self.done = 0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._shown = False

    def _fmt(self, n: int) -> str:
        return format_size(n) if self.as_bytes else f"{n}"

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if not self.enabled or (now - self._last < self.interval_s and done != self.total):
            return
        self._last = now
        elapsed = max(now - self._t0, 1e-9)
        count = f"{self._fmt(done)}/{self._fmt(self.total)}" if self.total else self._fmt(done)
        rate = f"{format_size(int(done / elapsed))}/s" if self.as_bytes else f"{done / elapsed:.0f} {self.unit}/s"
        pct = f" {done / self.total:4.0%}" if self.total else ""
        extra = f"  {note}" if note else ""
        unit = f" {self.unit}" if self.unit and not self.as_bytes else ""
        self.stream.write(f"\r\x1b[K{self.label}:{pct} {count}{unit} ({rate}, {elapsed:.0f}s){extra}")
        self.stream.flush()
        self._shown = True

    def advance(self, n: int = 1, note: str = "") -> None:
        self.update(self.done + n, note=note)

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False
