"""Read-ahead of a batch of disk pages: long runs of consecutive pages are asked
of the kernel in one ``madvise(MADV_WILLNEED)`` before the reader threads copy them.

Why: a cold page read through the map faults, and the kernel reads one
read-around window centred on the fault (the device's ``read_ahead_kb``), then
the next fault waits for the next window. Pages put one after another (a
prefix's chain) lie in consecutive overflow pages of the file, so a batch's
pages form a few long runs; one ``WILLNEED`` per run queues the whole run's I/O
at once, as a sequential ``read`` of it would, and the copies then find it in
the page cache or in flight. Runs no longer than two read-around windows gain
nothing and lose the neighbours the read-around brings in for free (measured,
docs/benchmarks.md "Disk tier"), so only longer runs are hinted.

This is a hint only: the reads that follow look every page up again and verify
it, so a page moved or freed in between costs a wasted read, never a wrong one.
Where ``madvise`` cannot be called (no libc symbol) nothing is hinted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

import lmdb
import numpy as np

__all__ = ["MAX_GAP_BYTES", "device_window", "hint_runs", "page_runs"]

MADV_WILLNEED = 3
# Values of one run are separated by B-tree pages now and then (a short forward
# jump); a gap up to this size is read along rather than splitting the run.
MAX_GAP_BYTES = 1 << 20
_PAGE = 4096
DEFAULT_WINDOW = 8 << 20  # when the device's read-ahead cannot be read


def _load_madvise():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # a ctypes call releases the GIL while the kernel queues the I/O


_madvise = _load_madvise()


def device_window(path: str) -> int:
    """Bytes the kernel reads around a fault of a file in directory `path`: its
    block device's ``read_ahead_kb`` (a partition's is its disk's), else 8 MiB."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(queue) as f:
                kb = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if kb > 0:
            return kb << 10
    return DEFAULT_WINDOW


def page_runs(txn: lmdb.Transaction, db: lmdb._Database, keys: Sequence[bytes],
              max_gap: int = MAX_GAP_BYTES) -> list[tuple[int, int]]:
    """[start, end) map addresses of the runs the pages of `keys` form, in address
    order, values at most `max_gap` apart merged. A cursor lookup returns the value's
    place in the map without touching its data (``txn.get`` would fault all of it in);
    `txn` must be a ``buffers=True`` transaction. Missing keys are skipped."""
    spans = []
    cur = txn.cursor(db=db)
    for k in keys:
        if cur.set_key(k):
            v = cur.value()
            addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
            spans.append((addr, addr + len(v)))
    spans.sort()
    runs: list[list[int]] = []
    for lo, hi in spans:
        if runs and lo - runs[-1][1] <= max_gap:
            runs[-1][1] = max(hi, runs[-1][1])
        else:
            runs.append([lo, hi])
    return [(lo, hi) for lo, hi in runs]


def hint_runs(runs: Sequence[tuple[int, int]], min_bytes: int) -> int:
    """``madvise(WILLNEED)`` each run of at least `min_bytes`; the bytes hinted.
    Call it while the transaction that found the runs is open (its pages stay put)."""
    if _madvise is None:
        return 0
    hinted = 0
    for lo, hi in runs:
        if hi - lo < min_bytes:
            continue
        start = lo & ~(_PAGE - 1)
        if _madvise(start, hi - start, MADV_WILLNEED) == 0:  # a failure only loses the hint
            hinted += hi - start
    return hinted
