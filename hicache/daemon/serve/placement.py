"""`hicache serve --cpus LIST` (`cpus` in the config): the CPUs the daemon runs on.

Applied first thing at start, before the daemon builds anything: Linux keeps an affinity per
thread, and a new thread inherits its creator's, so the threads that exist then (numpy's
OpenBLAS pool is started on import) are each moved, and every thread started later (the
disk tier's writer, the remote tier's workers) starts on the same CPUs.

Where it pays (docs/operations/daemon.md, "CPU placement"): keeping the daemon off the cores
an engine's forward pass is bound to. A list naming a CPU this process may not use (offline,
outside its cpuset or the affinity it was started with) is refused, with the CPUs it may use.
"""

from __future__ import annotations

import logging
import os

from hicache.config import Config
from hicache.cpu_list import format_cpu_list
from hicache.errors import ConfigError

log = logging.getLogger(__name__)


def check_cpus(cpus: tuple[int, ...] | set[int], allowed: set[int]) -> None:
    """ConfigError unless every CPU of `cpus` is one of `allowed`."""
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ConfigError(f"--cpus {format_cpu_list(set(cpus))}: CPU {format_cpu_list(outside)} is not one this "
                          f"daemon may run on (allowed: {format_cpu_list(allowed)}; see `taskset -cp $$` and the "
                          f"service's CPUAffinity=)")


def pin_to_cpus(config: Config) -> None:
    """Move this process's threads to `config.cpus` (nothing when it is empty)."""
    if not config.cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpus: this platform cannot set a process's CPUs")
    cpus = set(config.cpus)
    check_cpus(cpus, os.sched_getaffinity(0))
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("daemon on CPUs %s (--cpus)", format_cpu_list(cpus))


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: only this thread is known
        return [0]
