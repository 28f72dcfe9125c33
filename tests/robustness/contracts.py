"""Where this suite leans on interfaces that issue 14's fixes add: one small function
each, so a rename at merge time is a one-line change here.

- `Code.FORBIDDEN` (rpc/protocol.py): a peer without the admin role, or acting on a
  namespace it did not register.
- `Code.HELLO_REQUIRED`: a request before a successful `hello`.
- Disk tier counters in `stats()["tiers"]["disk"]`: `quarantined` (environments moved
  aside at start, defect 8) and `write_faults` (ENOSPC / EROFS / EACCES met at run
  time, which degrade the tier, defect 11).
- `Config.max_event_backlog_bytes` (HICACHE_MAX_EVENT_BACKLOG_BYTES): a subscriber with
  more unsent events is dropped (defect 6).
"""

from __future__ import annotations

from typing import Any

FORBIDDEN = "FORBIDDEN"
HELLO_REQUIRED = "HELLO_REQUIRED"
# Never acceptable as an answer: it means input reached a handler unvalidated.
INTERNAL = "INTERNAL"


def error_code(reply: dict) -> str | None:
    err = reply.get("error")
    return str(err.get("code")) if isinstance(err, dict) else None


def is_refusal(reply: dict) -> bool:
    """A non-admin peer's destructive or cross-namespace call was refused for its role."""
    return error_code(reply) == FORBIDDEN


def _disk_counter(stats: dict, name: str) -> int:
    disk = stats.get("tiers", {}).get("disk")
    assert isinstance(disk, dict), f"stats has no disk tier: {stats.get('tiers')!r:.300}"
    assert name in disk, (f"stats()['tiers']['disk'] has no {name!r} counter (issue 14 asks for one); "
                          f"it has {sorted(disk)}")
    value: Any = disk[name]
    assert isinstance(value, int) and not isinstance(value, bool), f"disk {name} = {value!r} is not a count"
    return value


def quarantined(stats: dict) -> int:
    """How many damaged disk environments the daemon moved aside at start."""
    return _disk_counter(stats, "quarantined")


def disk_degraded(stats: dict) -> int:
    """How many write faults (disk full, read-only, ...) degraded the disk tier at run time."""
    return _disk_counter(stats, "write_faults")


def small_event_backlog_env() -> dict[str, str]:
    """Daemon settings under which a subscriber with about 1 MiB of unsent events is
    dropped, so a test reaches the cap quickly."""
    return {"HICACHE_MAX_EVENT_BACKLOG_BYTES": "1MiB"}
