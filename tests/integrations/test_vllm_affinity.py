"""Where the vLLM worker's copy thread runs: off the cores vLLM binds its OpenMP
threads to, read from the variables vLLM's CPU executor sets, in a real process
whose main thread torch's OpenMP runtime has pinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from tests.integrations.vllm_required import PATIENT  # noqa: F401  (skips, or fails under CI, without vLLM)
from hicache.errors import ConfigError
from hicache.integrations.vllm.affinity import (copy_thread_cpus, omp_bound_cpus, online_cpus, parse_cpu_list,
                                                pin_this_thread)


def test_cpu_lists():
    assert parse_cpu_list("0-3,8 10") == {0, 1, 2, 3, 8, 10}
    assert parse_cpu_list("0-6:2") == {0, 2, 4, 6}
    assert parse_cpu_list(" 5 ") == {5}
    for bad in ("a", "3-1", "1-", "0-4:0", "{1}"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_openmp_bindings_vllm_writes():
    assert omp_bound_cpus({"OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}) == {1}
    assert omp_bound_cpus({"OMP_PLACES": "{0,1,2}"}) == {0, 1, 2}
    assert omp_bound_cpus({"OMP_PLACES": "{4:3:2},{9}"}) == {4, 6, 8, 9}
    assert omp_bound_cpus({"GOMP_CPU_AFFINITY": "0 1 2"}) == {0, 1, 2}
    assert omp_bound_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3,7]"}) == {2, 3, 7}
    for unknown in ({}, {"OMP_PLACES": "cores"}, {"OMP_PLACES": "{0:2}:4:2"}, {"KMP_AFFINITY": "compact"}):
        assert omp_bound_cpus(unknown) is None


def test_copy_cpus_are_the_rest_unless_told():
    online = online_cpus()
    last = max(online)
    spare = online - {last}
    assert copy_thread_cpus({"OMP_PLACES": f"{{{last}}}"}) == (spare or None)
    assert copy_thread_cpus({"OMP_PLACES": "{" + ",".join(map(str, online)) + "}"}) is None  # nothing left over
    assert copy_thread_cpus({}) is None  # no binding: threads share every core anyway
    assert copy_thread_cpus({"OMP_PLACES": f"{{{last}}}", "HICACHE_COPY_CPUS": "inherit"}) is None
    assert copy_thread_cpus({"OMP_PLACES": f"{{{last}}}", "HICACHE_COPY_CPUS": "0-1"}) == {0, 1}
    with pytest.raises(ConfigError, match="HICACHE_COPY_CPUS"):
        copy_thread_cpus({"HICACHE_COPY_CPUS": "first"})


def test_pinning_moves_only_the_calling_thread():
    mine = os.sched_getaffinity(0)
    target = {min(mine)}
    seen: list[set[int]] = []

    def copy_thread() -> None:
        pin_this_thread(target)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=copy_thread)
    t.start()
    t.join()
    assert seen == [target]
    assert os.sched_getaffinity(0) == mine


_CHILD = """
import json, os, threading
import torch  # libgomp reads OMP_PLACES and pins this (the main) thread
from hicache.integrations.vllm.affinity import copy_thread_cpus, pin_this_thread
main = os.sched_getaffinity(0)
cpus = copy_thread_cpus()
out = {}
def run():
    out["inherited"] = sorted(os.sched_getaffinity(0))
    pin_this_thread(cpus)
    torch.ones(1 << 16).sum()  # a torch op on the copy thread does not pull it back
    out["copy"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=run); t.start(); t.join()
print(json.dumps({"main": sorted(main), **out}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to put the copy thread on another")
def test_a_worker_process_bound_like_vllms_moves_its_copy_thread():
    allowed = sorted(os.sched_getaffinity(0))
    model = allowed[-1]  # vLLM's auto binding gives workers the last cores and reserves the first
    env = {**os.environ, "OMP_PLACES": f"{{{model}}}", "OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "1"}
    env.pop("HICACHE_COPY_CPUS", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["main"] == [model] and got["inherited"] == [model]  # what the copy thread had before
    assert got["copy"] == [c for c in allowed if c != model]


def test_other_ranks_cores_are_not_spare():
    online = online_cpus()
    last = max(online)
    others = sorted(online - {last})
    if not others:
        pytest.skip("one CPU: no spare to compare")
    listed = {"OMP_PLACES": f"{{{last}}}", "VLLM_CPU_OMP_THREADS_BIND": f"{others[0]}|{last}"}
    assert copy_thread_cpus(listed) == (set(others[1:]) or None)  # rank 0's core is not spare for rank 1
    assert copy_thread_cpus({**listed, "VLLM_CPU_OMP_THREADS_BIND": "auto"}) == set(others)
