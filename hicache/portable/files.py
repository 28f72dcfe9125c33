"""Opening export and import files without being fooled by what another local user planted.

An export is written to ``FILE.part`` and renamed over ``FILE`` once complete. Both names
live in a directory the user chose, which other users may be able to write to (``/tmp``):

- ``FILE.part`` is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600, relative to the
  directory opened once (``openat``), so a link planted at that name is never followed and
  the file is private whatever the umask. Any existing ``FILE.part`` (a link, or the leftover
  of an interrupted export) is refused and left alone: it may be another export in flight,
  and removing it is the user's decision.
- ``FILE`` may be replaced only when it is a regular file owned by us (an earlier export);
  a link, fifo or someone else's file there is refused. ``rename`` replaces a name and never
  follows a link at it, and before it we check that ``FILE.part`` is still the file we wrote.

An import reads only a regular file: a fifo or a device would otherwise block the CLI (a fifo's
open waits for a writer) or feed it without end.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hicache.errors import HiCacheError

PART_SUFFIX = ".part"


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a special file"


class OutputFile:
    """FILE written through FILE.part: create(), write to the fd, commit() or discard()."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        self.part = path.with_name(path.name + PART_SUFFIX)
        self._ino: tuple[int, int] | None = None  # (st_dev, st_ino) of the FILE.part we created
        self._dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.lstat(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None

    def _check_target(self) -> None:
        st = self._lstat(self.path.name)
        if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
            owner = "" if st.st_uid == os.geteuid() else f" owned by uid {st.st_uid}"
            raise HiCacheError(f"{self.path} exists and is {_kind(st)}{owner}, not an export of ours; "
                               "refusing to replace it")

    def create(self) -> int:
        """Create FILE.part (0600, never through a link); returns its fd, for writing."""
        self._check_target()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.part.name, flags, 0o600, dir_fd=self._dir_fd)
        except FileExistsError:
            st = self._lstat(self.part.name)
            kind = _kind(st) if st is not None else "a file"
            raise HiCacheError(f"{self.part} already exists ({kind}): another export is writing it, or one was "
                               "interrupted; remove it and retry") from None
        st = os.fstat(fd)
        self._ino = (st.st_dev, st.st_ino)
        return fd

    def _part_is_ours(self) -> bool:
        st = self._lstat(self.part.name)
        return st is not None and (st.st_dev, st.st_ino) == self._ino

    def commit(self) -> None:
        """Rename the complete FILE.part over FILE (the caller has written, fsynced and closed the fd)."""
        if not self._part_is_ours():
            raise HiCacheError(f"{self.part} was replaced while the export was writing it; {self.path} not written")
        self._check_target()
        os.replace(self.part.name, self.path.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._ino = None
        os.fsync(self._dir_fd)  # the rename itself survives a crash

    def close(self) -> None:
        """Remove FILE.part if it is still the one we created and not committed; close the directory."""
        try:
            if self._ino is not None and self._part_is_ours():
                os.unlink(self.part.name, dir_fd=self._dir_fd)
        finally:
            self._ino = None
            os.close(self._dir_fd)


def open_input(path: str | Path) -> int:
    """A read-only fd of a regular file; HiCacheError for a fifo, device, directory or socket."""
    st = os.stat(path)  # refuse before opening: opening a device can act on it
    if not stat.S_ISREG(st.st_mode):
        raise HiCacheError(f"{path} is {_kind(st)}, not a regular file")
    # O_NONBLOCK: should a fifo be swapped in after the stat, open must not wait for its writer
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HiCacheError(f"{path} is {_kind(st)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
