"""The daemon as a process: its memory, a cap on its address space, its exit."""

from __future__ import annotations

import resource
import subprocess


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon (the heap: where leaks show), RssShmem (the arena) and VmSize, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem", "RssFile", "VmSize"):
                out[name] = int(rest.split()[0])
    return out


def cap_address_space(pid: int, extra_bytes: int = 2 << 30) -> None:
    """Let the daemon grow by `extra_bytes` of address space at most. An unvalidated
    size (a bincount over 2**31 page ids, ...) then fails inside the daemon, where the
    suite sees it, instead of pushing the shared test machine into the OOM killer."""
    limit = memory_kib(pid)["VmSize"] * 1024 + extra_bytes
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The exit status, or None when it is still running after `timeout_s`."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None
