"""Which CPUs the worker's copy thread runs on: those vLLM's OpenMP threads are not bound to.

vLLM's CPU executor starts each worker with its OpenMP threads bound to that
rank's cores (`OMP_PLACES`, `GOMP_CPU_AFFINITY` or `KMP_AFFINITY` in the
worker's environment), and libgomp pins the process's main thread to the
first place as torch is imported. Every thread the worker starts inherits that
mask, so the copy thread would time-share the forward pass's core: with one
core per worker, a save running beside the next step's prefill slows that
step down by the save's whole duration. vLLM keeps cores out of the workers'
lists for other work (`VLLM_CPU_NUM_OF_RESERVED_CPU`; with a KV connector it
reserves one more per rank, and its own NIXL connector pins its transfer
thread there); the copy thread moves to those cores, where its copies (the
GIL released) overlap the forward pass instead of delaying it. With several
ranks, "those cores" are the CPUs of the NUMA nodes this rank is bound to that
no rank's OpenMP threads use: vLLM's automatic binding gives each rank its own
node and reserves the node's last cores, and an explicit
`VLLM_CPU_OMP_THREADS_BIND` ('0-3|4-7') lists every rank's cores.

`HICACHE_COPY_CPUS`: a CPU list (`2`, `0-3,8`) to run the copy thread on
instead, or `inherit` to leave it on the worker's cores. Without a binding in
the environment, or with no CPU left over, the thread stays where it is.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from hicache.cpu_list import parse_cpu_list
from hicache.errors import ConfigError

log = logging.getLogger(__name__)


def _omp_places(text: str) -> set[int]:
    """CPUs of an explicit OMP_PLACES ('{0,1},{2:2}', '{4:3:2}'); ValueError for the
    abstract names ('cores', 'threads') and forms vLLM does not write."""
    if not re.fullmatch(r"\s*\{[^{}]*\}(\s*,\s*\{[^{}]*\})*\s*", text):
        raise ValueError(f"not an explicit OMP_PLACES: {text!r}")
    cpus: set[int] = set()
    for place in re.findall(r"\{([^{}]*)\}", text):
        for item in place.split(","):
            parts = [int(p) for p in item.strip().split(":")]  # lower[:length[:stride]]
            lower, length, stride = (parts + [1, 1])[:3]
            if len(parts) > 3 or length < 1:
                raise ValueError(f"not an explicit OMP_PLACES: {text!r}")
            cpus.update(lower + i * stride for i in range(length))
    return cpus


def omp_bound_cpus(env: Mapping[str, str]) -> set[int] | None:
    """The CPUs this process's OpenMP threads are bound to, from the variables vLLM's
    CPU executor sets; None where none names CPUs."""
    try:
        if places := env.get("OMP_PLACES"):
            return _omp_places(places)
        if gomp := env.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(gomp)
        if m := re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", "")):
            return parse_cpu_list(m[1].replace("{", "").replace("}", ""))
    except ValueError as e:
        log.debug("OpenMP binding not understood (%s): the copy thread keeps its CPUs", e)
    return None


def online_cpus() -> set[int]:
    try:
        return parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def node_cpus(cpus: set[int]) -> set[int]:
    """Every CPU of the NUMA nodes `cpus` lie on (all online CPUs where sysfs has no nodes)."""
    out: set[int] = set()
    for f in Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"):
        try:
            node = parse_cpu_list(f.read_text())
        except (OSError, ValueError):
            continue
        if node & cpus:
            out |= node
    return out or online_cpus()


def _all_ranks_cpus(env: Mapping[str, str]) -> set[int]:
    """The cores of every rank where VLLM_CPU_OMP_THREADS_BIND lists them ('0-3|4-7')."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if bind in ("auto", "nobind", ""):
        return set()
    try:
        return set().union(*(parse_cpu_list(part) for part in bind.split("|")))
    except ValueError:
        return set()


def copy_thread_cpus(env: Mapping[str, str] = os.environ) -> set[int] | None:
    """Where the copy thread should run: HICACHE_COPY_CPUS, else the CPUs of this rank's
    NUMA nodes no rank's OpenMP threads are bound to; None to leave it where it is.
    ConfigError for a HICACHE_COPY_CPUS that is not a CPU list (at start-up, not a
    silent default)."""
    want = env.get("HICACHE_COPY_CPUS", "").strip()
    if want == "inherit":
        return None
    if want:
        try:
            cpus = parse_cpu_list(want)
        except ValueError as e:
            raise ConfigError(f"HICACHE_COPY_CPUS: {e} (a list like '2' or '0-3,8', or 'inherit')") from None
        return cpus or None
    bound = omp_bound_cpus(env)
    if not bound:
        return None
    return (node_cpus(bound) - bound - _all_ranks_cpus(env)) or None


def pin_this_thread(cpus: set[int] | None) -> None:
    """Pin the calling thread to `cpus` (None: leave it). The kernel keeps only the CPUs
    the process's cpuset allows; where that leaves none the thread stays put."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: this thread only
    except OSError as e:
        log.info("hicache: copy thread kept on CPUs %s (%s unusable: %s)",
                 sorted(os.sched_getaffinity(0)), sorted(cpus), e)
        return
    log.info("hicache: copy thread on CPUs %s, away from vLLM's OpenMP threads", sorted(os.sched_getaffinity(0)))
