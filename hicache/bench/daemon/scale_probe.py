"""What `hicache bench scale` reads of the processes it measures.

- `LoopProbe`: a process of its own times a no-op RPC (`sync`) back to back on
  its own connection, so a handler that holds the daemon's event loop shows up
  as a late answer; `stall(a, b)` is the longest answer among those in flight
  during [a, b], above the probe's quiet median. `time.monotonic` is one clock
  for every process of the machine.
- `/proc` readers: a process's memory by kind (its heap is RssAnon: the arena is
  a memfd, RssShmem; LMDB's map is a file mapping, RssFile) and the resident
  part of one mapped file (smaps), and its CPU seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from hicache.client.connection import RpcConnection

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of a process, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(value.split()[0])
    return out


def mapped_rss_kib(pid: int, suffix: str) -> int:
    """Resident KiB of the mappings of files whose path ends with `suffix` (smaps)."""
    total = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(suffix)
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def _probe(socket_path: str, ready: mp.Event, stop: mp.Event, out_path: str) -> None:
    conn = RpcConnection.connect(socket_path, timeout_s=30)
    conn.hello(timeout_s=30)
    ready.set()
    starts, rtts = [], []
    while not stop.is_set():
        t0 = time.monotonic()
        conn.call("sync", None, timeout_s=60)
        starts.append(t0)
        rtts.append(time.monotonic() - t0)
    conn.close()
    np.save(out_path, np.array([starts, rtts], dtype=np.float64))


class LoopProbe:
    """`sync` round trips from a process of its own, for as long as it runs."""

    def __init__(self, socket_path: str, workdir: Path) -> None:
        ctx = mp.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._out = str(workdir / "loop-probe.npy")
        self._proc = ctx.Process(target=_probe, args=(socket_path, self._ready, self._stop, self._out), daemon=True)
        self.starts = np.empty(0)
        self.rtts = np.empty(0)

    def __enter__(self) -> LoopProbe:
        self._proc.start()
        if not self._ready.wait(60):
            raise RuntimeError("the loop probe did not connect within 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(60)
        if self._proc.exitcode == 0:
            self.starts, self.rtts = np.load(self._out)

    def quiet_s(self, a: float, b: float) -> float:
        """The median round trip of the probes started in [a, b]."""
        sel = self.rtts[(self.starts >= a) & (self.starts < b)]
        return float(np.median(sel)) if len(sel) else 0.0

    def stall(self, a: float, b: float, quiet_s: float) -> float:
        """The longest round trip of the probes in flight during [a, b], less `quiet_s`."""
        sel = self.rtts[(self.starts < b) & (self.starts + self.rtts > a)]
        return max(0.0, float(sel.max()) - quiet_s) if len(sel) else 0.0
