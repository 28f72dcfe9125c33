"""Where and at which priority `hicache bench vllm --concurrency` runs a hicache daemon, and the
CPU hogs it can run beside everything (`--hogs N`).

A hicache configuration may carry placement options after its name, each `:key=value`:

- `cpus=LIST`: `hicache serve --cpus LIST` (the daemon and its threads on those CPUs);
- `nice=N`: the daemon's threads at nice N, as systemd's `Nice=` starts them (below 0 needs
  root or CAP_SYS_NICE);
- `weight=W`: the daemon alone in a CPU cgroup of weight W, as systemd's `CPUWeight=` puts
  a service (default 100; a cgroup v1 machine gets cpu.shares W * 1024 / 100, as systemd
  writes there). Needs a writable CPU cgroup hierarchy (root); the group is removed after.

e.g. `--compare none,hicache,hicache:cpus=1,hicache:nice=-10:cpus=1`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hicache.cpu_list import parse_cpu_list

log = logging.getLogger(__name__)

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
KEYS = ("cpus", "nice", "weight")


@dataclass(frozen=True)
class DaemonPlacement:
    cpus: str | None = None
    nice: int | None = None
    weight: int | None = None

    @classmethod
    def parse(cls, options: list[str]) -> DaemonPlacement:
        """From `key=value` items; ValueError naming what is wrong."""
        values: dict[str, str] = {}
        for item in options:
            key, eq, value = item.partition("=")
            if not eq or key not in KEYS or not value:
                raise ValueError(f"placement option {item!r}: use {', '.join(k + '=...' for k in KEYS)}")
            if key in values:
                raise ValueError(f"placement option {key} given twice")
            values[key] = value
        try:
            nice = int(values["nice"]) if "nice" in values else None
            weight = int(values["weight"]) if "weight" in values else None
        except ValueError:
            raise ValueError(f"nice and weight are integers: {options}") from None
        if nice is not None and not -20 <= nice <= 19:
            raise ValueError(f"nice={nice}: between -20 and 19")
        if weight is not None and not 1 <= weight <= 10000:
            raise ValueError(f"weight={weight}: between 1 and 10000, as systemd's CPUWeight=")
        if "cpus" in values:
            parse_cpu_list(values["cpus"])  # the daemon checks them against the machine's
        return cls(values.get("cpus"), nice, weight)

    def serve_flags(self) -> list[str]:
        return ["--cpus", self.cpus] if self.cpus else []

    def apply(self, pid: int, name: str) -> CpuGroup | None:
        """Nice and weight for a started daemon (its threads, and so those they start later);
        the cgroup made for the weight, to `remove` once the daemon stopped."""
        if self.nice is not None:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), self.nice)
        if self.weight is None:
            return None
        group = CpuGroup.create(re.sub(r"[^A-Za-z0-9_-]", "-", f"hicache-bench-{os.getpid()}-{name}"), self.weight)
        group.add(pid)
        return group


class CpuGroup:
    """A CPU cgroup of its own weight (v2 cpu.weight, or v1 cpu.shares)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, weight: int) -> CpuGroup:
        if "cpu" in _read(CGROUP_V2 / "cgroup.subtree_control").split():
            path, knob, value = CGROUP_V2 / name, "cpu.weight", str(weight)
        elif (CGROUP_V1_CPU / "cpu.shares").exists():
            path, knob, value = CGROUP_V1_CPU / name, "cpu.shares", str(weight * 1024 // 100)
        else:
            raise SystemExit("weight=: no CPU cgroup controller here (cgroup v2 with cpu enabled at the root, "
                             "or v1's cpu hierarchy at /sys/fs/cgroup/cpu)")
        try:
            path.mkdir()
            (path / knob).write_text(value)
        except OSError as e:
            raise SystemExit(f"weight=: cannot make the cgroup {path} ({e.strerror}): it needs root") from None
        log.info("cgroup %s: %s = %s", path, knob, value)
        return cls(path)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # every thread of the process

    def remove(self) -> None:
        """Once its processes are gone (an empty group can be removed)."""
        try:
            self.path.rmdir()
        except OSError as e:
            log.warning("could not remove the cgroup %s: %s", self.path, e.strerror)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class CpuHogs:
    """`count` processes that each keep one CPU busy until stopped (`--hogs`): the engine, the
    daemon and a peer's server under a machine as loaded as a busy host."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> CpuHogs:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()
