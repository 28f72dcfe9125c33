"""The defaults derived from this machine, so `hicache serve` starts with no config file.

The socket under `$XDG_RUNTIME_DIR` (or a private 0700 directory under /tmp), state under
`$STATE_DIRECTORY` (systemd) or `$XDG_STATE_HOME/hicache`, and tier capacities sized
from what this machine has free. Clients and admin commands find the socket here too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

def private_socket_dir() -> Path:
    """The socket's directory when there is no runtime directory: `$TMPDIR/hicache-<uid>`.
    Any local user can create that name first, so the daemon serves there only when it is
    a real directory of its own with mode 0700 (hicache/daemon/serve/app.py)."""
    return Path(tempfile.gettempdir()) / f"hicache-{os.getuid()}"


def default_socket_path() -> Path:
    runtime = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime.split(":")[0]) / "hicache.sock"
    return private_socket_dir() / "hicache.sock"


SERVICE_SOCKET = Path("/run/hicache/hicache.sock")  # where systemd/hicache.socket listens


def admin_socket_path(explicit: str | None = None) -> str:
    """The socket admin commands talk to: --socket, HICACHE_SOCKET_PATH, this user's
    default, or the system service's when only that one exists."""
    if explicit:
        return explicit
    if os.environ.get("HICACHE_SOCKET_PATH"):
        return os.environ["HICACHE_SOCKET_PATH"]
    mine = default_socket_path()
    if not mine.exists() and SERVICE_SOCKET.exists():
        return str(SERVICE_SOCKET)
    return str(mine)


def default_state_dir() -> Path:
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "hicache"


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_host_capacity() -> int:
    """A quarter of available memory, between 64 MiB and 64 GiB: the engines need the rest."""
    return max(64 << 20, min(mem_available_bytes() // 4, 64 << 30))


DEFAULT_DISK_CAPACITY = 4 << 30
MIN_DISK_CAPACITY = 1 << 20  # an LMDB map smaller than this holds little beyond its own pages


def default_disk_capacity(state_dir: Path) -> int:
    """4 GiB or a tenth of the free space where state lives, whichever is smaller (at least
    64 MiB). The capacity is allocated on disk at start (the LMDB file, see
    hicache/daemon/movers/disk_startup.py), so a first run must not take a large share of a
    disk nobody sized for it: 4 GiB holds ~60,000 pages of 64 KiB, more than a single
    machine's engines reuse in the benches; a deployment sets --disk-capacity."""
    probe = state_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return max(64 << 20, min(free // 10, DEFAULT_DISK_CAPACITY))
