"""`hicache doctor`: checks the socket (reachable, mode 0660, owner), the daemon (pid,
version), memlock (the daemon's RLIMIT_MEMLOCK against its arena, and
whether the arena is mlocked), shared memory (the arena's range and a
slab memfd mapped here as an engine maps them, /dev/shm, vm.overcommit), the LMDB disk tier
(use, corrupt pages, write errors, queue depth, reader slots, map use),
free space where the state lives, the age of the last disk commit, and
the native paths (a warning for each hot path the daemon runs in Python,
with its measured cost). Each check is ok / warn / fail with one line; exit 1
if any fails, 2 when the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import stat
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from hicache import __version__
from hicache.config import SERVICE_SOCKET, admin_socket_path, format_size
from hicache.errors import DaemonUnavailable, HiCacheError
from hicache.tiers.host.arena import HostArena, new_slab_memfd

SYSTEM_SOCKET = str(SERVICE_SOCKET)  # where hicache.socket listens

# thresholds
LOW_FREE_BYTES = 1 << 30
CRITICAL_FREE_BYTES = 64 << 20
STATE_EXTRA_WARN_BYTES = 64 << 20  # the namespaces sidecar, LMDB's lock file, the state marker: far less
SHM_LOW_BYTES = 64 << 20
MAP_FULL_WARN = 0.9
QUEUE_FULL_WARN = 0.8
READERS_FULL_WARN = 0.9
WRITER_STALL_S = 60.0  # pages queued and no commit for this long: the writer is stuck
# What each native path costs in Python: `hicache bench native --json`, measured and shipped.
NATIVE_COSTS_FILE = "native_costs.json"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def socket_check(path: str) -> Check:
    """The socket file itself; DaemonUnavailable when there is none to connect to."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        hint = ""
        if path != SYSTEM_SOCKET and os.path.exists(SYSTEM_SOCKET):
            hint = f"; the system service listens on {SYSTEM_SOCKET}: pass --socket {SYSTEM_SOCKET}"
        raise DaemonUnavailable(f"no socket at {path}{hint}") from None
    except OSError as e:
        raise DaemonUnavailable(f"cannot stat {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{path} exists but is not a socket")
    mode = stat.S_IMODE(st.st_mode)
    detail = f"{path}: mode {mode:04o}, owner {_owner(st)}"
    if mode & 0o007:
        return Check("socket", "warn", f"{detail}: other users can connect (expected 0660; peer uids are "
                                       "still checked)")
    if mode != 0o660:
        return Check("socket", "warn", f"{detail} (expected 0660: engines reach it through the group)")
    return Check("socket", "ok", detail)


def arena_check(hello: dict) -> Check:
    """Map as an engine maps the daemon's arena: reserve its address range, then put a
    sealed slab-sized memfd in it (the daemon sends each engine only the slabs of its own
    namespace, so the check brings its own)."""
    nbytes, slab_bytes, num_slabs = int(hello["arena_bytes"]), int(hello["slab_bytes"]), int(hello["num_slabs"])
    what = f"the {format_size(nbytes)} arena ({num_slabs} slabs of {format_size(slab_bytes)})"
    try:
        with HostArena.reserve(num_slabs, slab_bytes) as arena:
            arena.map_slab(num_slabs - 1, new_slab_memfd(slab_bytes, "hicache-doctor"), 1)
            arena.array[-1], arena.array[-slab_bytes]  # noqa: B018 - touch both ends of the slab
    except (OSError, HiCacheError) as e:
        return Check("arena", "fail", f"cannot map {what} as engines do: {e}")
    return Check("arena", "ok", f"{what} maps here as in an engine")


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def host_checks(arena_bytes: int) -> list[Check]:
    """Shared-memory limits of this machine (the daemon's, when run on its host)."""
    checks: list[Check] = []
    try:
        vfs = os.statvfs("/dev/shm")
        size, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
        detail = f"/dev/shm {format_size(size)}, {format_size(free)} free (engines' NCCL/torch IPC; the arena is a memfd)"
        checks.append(Check("shm", "warn" if free < SHM_LOW_BYTES else "ok", detail))
    except OSError as e:
        checks.append(Check("shm", "warn", f"/dev/shm unusable ({e.strerror}): engines' NCCL/torch IPC need it"))
    try:
        mode = int(Path("/proc/sys/vm/overcommit_memory").read_text())
    except (OSError, ValueError):
        checks.append(Check("overcommit", "ok", "vm.overcommit_memory unreadable; skipped"))
        return checks
    if mode == 2:
        info = _meminfo()
        room = info.get("CommitLimit", 0) - info.get("Committed_AS", 0)
        status = "warn" if room < arena_bytes else "ok"
        checks.append(Check("overcommit", status, f"vm.overcommit_memory=2 (strict): {format_size(max(room, 0))} "
                                                  "left to commit; engines' large allocations may fail"))
    else:
        checks.append(Check("overcommit", "ok", f"vm.overcommit_memory={mode}"))
    return checks


def daemon_checks(facts: dict) -> list[Check]:
    """Checks on what the daemon reported (its `doctor` RPC); pure, so it is testable."""
    checks: list[Check] = []
    version = facts["version"]
    detail = f"pid {facts['pid']}, hicache {version}, up {facts['uptime_s']:.0f}s, uid {facts['uid']}"
    if version != __version__:
        checks.append(Check("daemon", "warn", f"{detail}; this CLI is {__version__}"))
    else:
        checks.append(Check("daemon", "ok", detail))

    host = facts["host"]
    soft = facts["memlock_limit"][0]
    limit = "unlimited" if soft is None else format_size(soft)
    arena = format_size(host["capacity_bytes"])
    if host["locked"]:
        why = "" if soft is None or soft >= host["capacity_bytes"] else ", not binding: CAP_IPC_LOCK"
        checks.append(Check("memlock", "ok", f"arena of {arena} mlocked (RLIMIT_MEMLOCK {limit}{why})"))
    elif not host["mlock"]:
        checks.append(Check("memlock", "warn", f"mlock disabled in the config: the {arena} arena may be swapped out"))
    else:
        checks.append(Check("memlock", "warn", f"arena of {arena} not mlocked: RLIMIT_MEMLOCK is {limit}; "
                                               "set LimitMEMLOCK=infinity (or ulimit -l) for the daemon"))

    disk = facts.get("disk")
    if disk is None:
        checks.append(Check("disk", "ok", "no disk tier (--no-disk)"))
    else:
        checks.extend(_disk_checks(disk, facts["time"]))

    usage = facts.get("state_usage")  # an older daemon does not report it
    if usage is not None:
        checks.append(_state_usage_check(facts["state_dir"], usage))

    fs = facts["state_fs"]
    free, total = fs["free_bytes"], fs["total_bytes"]
    detail = f"{facts['state_dir']}: {format_size(free)} free of {format_size(total)}"
    if free < CRITICAL_FREE_BYTES:
        checks.append(Check("free disk", "fail", f"{detail}: the namespaces sidecar and logs cannot be written"))
    elif free < min(LOW_FREE_BYTES, total // 20):
        checks.append(Check("free disk", "warn", f"{detail}: low"))
    else:
        checks.append(Check("free disk", "ok", detail))
    return checks


def _state_usage_check(state_dir: str, usage: dict) -> Check:
    """What the state directory really takes (allocated blocks): the disk tier's file is its
    capacity, the rest is small; more means copies moved aside or files left by hand."""
    allocated, capacity = usage["allocated_bytes"], usage["disk_capacity"]
    detail = (f"{state_dir}: {format_size(allocated)} allocated in {usage['files']} files "
              f"(disk tier {format_size(capacity) if capacity else 'off'})")
    if allocated > capacity + STATE_EXTRA_WARN_BYTES:
        return Check("state dir", "warn", f"{detail}: more than the disk tier's capacity; "
                                          "look for quarantined copies (disk.corrupt-*)")
    return Check("state dir", "ok", detail)


def _disk_checks(disk: dict, now: float) -> list[Check]:
    checks: list[Check] = []
    used, cap = disk["used_bytes"], disk["capacity_bytes"]
    detail = (f"{disk['pages']} pages, {format_size(used)} of {format_size(cap)} "
              f"({disk['durability']} durability), queue {disk['queue_depth']}/{disk['max_queue_pages']}")
    problems = []
    if disk["corrupt_pages"]:
        problems.append(f"{disk['corrupt_pages']} corrupt pages dropped since start (check the storage)")
    if disk.get("write_errors"):
        problems.append(f"{disk['write_errors']} failed write transactions")
    if disk["queue_depth"] >= QUEUE_FULL_WARN * disk["max_queue_pages"]:
        problems.append("the write queue is nearly full (writes are being skipped)")
    map_use = disk["map_used_bytes"] / max(1, disk["map_size"])
    if map_use >= MAP_FULL_WARN:
        problems.append(f"the LMDB map is {map_use:.0%} used")
    checks.append(Check("lmdb", "warn" if problems else "ok", "; ".join([detail, *problems])))

    readers, slots = disk["num_readers"], disk["max_readers"]
    detail = f"{readers} of {slots} reader slots in use"
    if disk["stale_readers_cleared"]:
        checks.append(Check("lmdb readers", "warn", f"{detail}; cleared {disk['stale_readers_cleared']} stale "
                                                    "slots of dead processes"))
    elif readers >= READERS_FULL_WARN * slots:
        checks.append(Check("lmdb readers", "warn", f"{detail}: nearly exhausted"))
    else:
        checks.append(Check("lmdb readers", "ok", detail))

    last = disk["last_write_time"]
    if not last:
        status = "fail" if disk["queue_depth"] else "ok"
        detail = "no disk commit since the daemon started" + (f", {disk['queue_depth']} queued" if status == "fail"
                                                               else "")
        checks.append(Check("last write", status, detail))
    else:
        age = max(0.0, now - last)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))
        if disk["queue_depth"] and age > WRITER_STALL_S:
            checks.append(Check("last write", "fail", f"last commit {age:.0f}s ago ({when}) with "
                                                      f"{disk['queue_depth']} writes queued: the writer is stuck"))
        else:
            checks.append(Check("last write", "ok", f"last commit {age:.0f}s ago ({when})"))
    return checks


def measured_costs() -> dict:
    """The shipped `hicache bench native --json` output (date, machine, results), or {}."""
    try:
        return json.loads(resources.files("hicache.data").joinpath(NATIVE_COSTS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def cost_line(path: str, costs: dict) -> str:
    """What running native path `path` in Python costs, from the measured rows, or ""."""
    parts = [f"{r['op']} {r['ratio']:.1f}x" for r in costs.get("results", [])
             if r.get("path") == path and isinstance(r.get("ratio"), (int, float)) and r["ratio"] == r["ratio"]]
    if not parts:
        return ""
    return (f"{', '.join(parts)} the native time (hicache bench native, {costs.get('date', '?')}, "
            f"{costs.get('machine', '?')})")


def native_checks(paths: dict[str, dict], costs: dict) -> list[Check]:
    """One check per native path of the daemon (`stats`' `native` section): a warning for
    each that runs in Python, with what that costs."""
    checks = []
    for path, entry in paths.items():
        name = f"native {path.replace('_', ' ')}"
        if entry["runs"] == "python":
            cost = cost_line(path, costs) or "its cost is not measured"
            checks.append(Check(name, "warn", f"runs in Python ({entry['reason']}): {cost}"))
        else:
            checks.append(Check(name, "ok", entry["reason"]))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    from hicache.client.connection import RpcConnection

    path = admin_socket_path(args.socket_path)
    checks = [socket_check(path)]
    try:
        conn = RpcConnection.connect(path, timeout_s=10.0)
    except DaemonUnavailable as e:
        if not os.access(path, os.R_OK | os.W_OK):
            st = os.stat(path)
            raise DaemonUnavailable(f"{e.message} (socket owner {_owner(st)}, mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}: join its group)") from None
        raise
    try:
        hello, fds = conn.hello()
        for fd in fds:
            os.close(fd)
        checks.append(arena_check(hello))
        facts = conn.call("doctor")
        native = conn.call("stats").get("native") or {}  # an older daemon reports none
    finally:
        conn.close()
    reported = daemon_checks(facts)
    # socket, daemon, memlock, arena, shared memory, then the disk: the order an operator reads
    checks = [checks[0], *reported[:2], checks[1], *host_checks(facts["host"]["capacity_bytes"]), *reported[2:],
              *native_checks(native, measured_costs())]
    failures = sum(c.status == "fail" for c in checks)
    warnings = sum(c.status == "warn" for c in checks)
    if args.json:
        print(json.dumps({"socket": path, "checks": [asdict(c) for c in checks], "failures": failures,
                          "warnings": warnings, "daemon": facts}))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<5} {c.name:<{width}}  {c.detail}")
        print(f"{failures} failed, {warnings} warnings")
    return 1 if failures else 0
