"""The daemon's state directory: private, and usable or refused in one line.

The state directory holds the disk tier (``disk/``: LMDB's files hold every
tenant's KV, i.e. their prompts) and ``namespaces.msgpack``. The daemon runs
with umask 077 (``hicache.daemon.serve.app.serve``), so what it creates is 0700 /
0600; a directory or files left looser by an older version or by hand are
tightened here when the daemon's uid owns them (one log line), and named in a
warning when it does not. Symlinks inside it are never followed or changed
(the state directory itself may be one: its target is checked).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from hicache.errors import HiCacheError
from hicache.tiers.disk.env import unusable

log = logging.getLogger(__name__)

_OTHERS = 0o077  # group and other bits: none may stay


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory (0700) or tighten an existing one and what it
    holds (directories 0700, files 0600, one level into each directory)."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise HiCacheError(f"state directory {unusable(str(state_dir), e)}") from e
    paths = [state_dir]
    try:
        for entry in os.scandir(state_dir):
            paths.append(Path(entry.path))
            if entry.is_dir(follow_symlinks=False):
                paths.extend(Path(sub.path) for sub in os.scandir(entry.path))
    except OSError as e:
        log.warning("state directory %s: cannot list it to check its modes: %s", state_dir, e)
    tightened: list[str] = []
    for p in paths:
        try:
            st = os.stat(p) if p is state_dir else os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("%s: cannot check its mode: %s", p, e)
            continue
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not mode & _OTHERS:
            continue
        if st.st_uid != os.geteuid():
            log.warning("%s is mode %04o and belongs to uid %d: others can read it; make it private",
                        p, mode, st.st_uid)
            continue
        try:
            os.chmod(p, mode & ~_OTHERS)
        except OSError as e:
            log.warning("%s is mode %04o and cannot be made private: %s", p, mode, e)
            continue
        tightened.append(f"{p.name or p} ({mode:04o})")
    if tightened:
        log.warning("state directory %s: tightened %d paths that others could read to owner-only: %s",
                    state_dir, len(tightened), ", ".join(tightened[:8]) + (" ..." if len(tightened) > 8 else ""))


def allocated_bytes(state_dir: Path) -> tuple[int, int]:
    """(bytes allocated on disk, files) under the state directory: ``st_blocks``, not the
    apparent size, so a sparse file counts what it holds and a preallocated one all of
    it. Symlinks are counted as links, never followed; entries that vanish are skipped."""
    total = files = 0
    for root, dirs, names in os.walk(state_dir, onerror=lambda e: None):
        for name in [*names, *dirs]:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_blocks * 512
            files += not stat.S_ISDIR(st.st_mode)
    return total, files
