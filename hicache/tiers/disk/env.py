"""The disk tier's environment directory: the open protocol, the clean/unclean
marker, verification in a child process, cleanup after a failed open, and
quarantine of damaged files (record formats are format.py's).

Errors
- ``DiskTierDamaged``: the files are damaged, torn, foreign or of another
  format (MDB_INVALID, MDB_CORRUPTED, MDB_PAGE_NOTFOUND, an LMDB version
  mismatch, a data.mdb emptied or cut short, another format version, an
  unclean ``durability="none"`` environment from a previous boot). Nothing was
  written to them; the owner may move them aside with ``quarantine`` and open
  an empty tier in their place.
- ``DiskTierError``: the directory cannot be used (read-only, no space,
  permissions, an I/O error, another owner), in one line naming the path and
  the cause. A failed open removes the files it created in a fresh directory,
  and cuts data.mdb back to its old size in an existing one: the map that
  ``reserve`` allocates is the whole disk capacity, and a half-allocated one must not
  stay behind on a full disk.

Verification. LMDB answers most damage with an error, but some damaged B-trees
trip an assertion that abort()s the process (``Assertion 'IS_LEAF(mp)' failed
in mdb_cursor_next``), and reading a page past the end of a truncated file is
a SIGBUS. So before the owner touches an existing environment, a child process
(``python -m hicache.tiers.disk.env PATH``) reads the format record, the
totals, every meta record and every page key (not the page bytes: a read
checksums those). A child killed by a signal, or still running after
``VERIFY_TIMEOUT_S``, means a damaged environment: the daemon moves it aside
instead of dying at every start. It costs a process start (~0.3 s here) and,
read in C (scan.py), ~0.3 s per million pages; `hicache serve` starts it
before its own imports (`start_verify`), so that the two overlap.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import lmdb

from hicache.errors import DiskTierDamaged, DiskTierError
from hicache.tiers.disk import format as fmt
from hicache.tiers.disk import scan as disk_scan

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 300.0
# LMDB errors that say the files are damaged or foreign; any other lmdb.Error
# (read-only, I/O, locks, memory) is about where the files live.
DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
                 lmdb.IncompatibleError, lmdb.PanicError)
QUARANTINE_TAG = ".corrupt-"
_EXIT_DAMAGED = 3
_EXIT_UNUSABLE = 4


def unusable(path: str, e: OSError) -> DiskTierError:
    """One line for an OS error on the environment's directory."""
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else ""
    return DiskTierError(f"{path}: {e.strerror or e}" + (f" ({code})" if code else ""))


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def read_state(path: str) -> dict | None:
    try:
        with open(os.path.join(path, fmt.STATE_FILE), "rb") as f:
            state = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise DiskTierDamaged(f"{path}: unreadable {fmt.STATE_FILE}: {e}") from e
    except OSError as e:
        raise unusable(path, e) from e
    return state if isinstance(state, dict) else None


def write_state(path: str, *, clean: bool, durability: str) -> None:
    """Atomically replace the clean/unclean marker (tmp + fsync + rename + dir fsync)."""
    data = json.dumps({"clean": clean, "durability": durability, "boot_id": boot_id(),
                       "pid": os.getpid(), "time": time.time()}).encode()
    tmp = os.path.join(path, fmt.STATE_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(path, fmt.STATE_FILE))
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def lock_dir(path: str) -> int:
    try:
        fd = os.open(os.path.join(path, fmt.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise unusable(path, e) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskTierError(f"{path}: disk tier is already open (in this or another process)") from None
    return fd


def _hicache_dbs(env: lmdb.Environment, txn: lmdb.Transaction, path: str) -> dict:
    """The environment's hicache databases, its format checked; DiskTierDamaged if it has none."""
    try:
        dbs = {name: env.open_db(name, txn=txn, create=False) for name in (fmt.DB_INFO, fmt.DB_PAGES, fmt.DB_META)}
    except lmdb.Error as e:
        raise DiskTierDamaged(f"{path}: LMDB environment without the hicache databases "
                              f"(foreign or damaged: {e})") from e
    fmt.check_info(txn.get(fmt.INFO_FORMAT_KEY, db=dbs[fmt.DB_INFO]), path)
    return dbs


def inspect_env(path: str) -> tuple[int, int] | None:
    """Validate an existing environment without writing to it: None if it is
    empty (a fresh one), else its (used_bytes, num_pages)."""
    try:
        env = lmdb.open(path, readonly=True, create=False, max_dbs=8, lock=True)
    except DAMAGE_ERRORS as e:
        raise DiskTierDamaged(f"{path}: not a usable LMDB environment ({e})") from e
    except lmdb.Error as e:
        raise DiskTierError(f"{path}: cannot open the LMDB environment: {e}") from e
    try:
        with env.begin() as txn:
            if txn.stat()["entries"] == 0:
                return None
            dbs = _hicache_dbs(env, txn, path)
            return fmt.unpack_totals(txn.get(fmt.INFO_TOTALS_KEY, db=dbs[fmt.DB_INFO]), path)
    except DAMAGE_ERRORS as e:
        raise DiskTierDamaged(f"{path}: damaged LMDB environment ({e})") from e
    except lmdb.Error as e:
        raise DiskTierError(f"{path}: cannot read the LMDB environment: {e}") from e
    finally:
        env.close()


# ----------------------------------------------------------- verification (child)


class _Child(NamedTuple):
    proc: subprocess.Popen
    scan_fd: int  # a memfd the child writes its scan of the records into (disk_scan.dump)


_early: dict[str, _Child] = {}  # children started before their environment is opened
_scans: dict[str, int] = {}  # memfds of the scans the children of passed verifications wrote


def start_verify(path: str) -> None:
    """Start the child that reads the environment now, for `verify` to collect: the
    daemon starts it before its own imports, so that the two overlap (~0.5 s of a start at
    a million pages). Nothing when there is no environment yet."""
    key = os.path.realpath(path)
    if key not in _early and os.path.exists(os.path.join(key, "data.mdb")):
        _early[key] = _spawn(key)


def discard_verify(path: str) -> None:
    """Forget (and stop) a child `start_verify` started: the environment is not read after all."""
    child = _early.pop(os.path.realpath(path), None)
    if child is not None:
        child.proc.kill()
        child.proc.communicate()
        os.close(child.scan_fd)


def verify(path: str, timeout_s: float = VERIFY_TIMEOUT_S) -> None:
    """Read the whole environment's structure in a child process (module
    docstring); raises DiskTierDamaged or DiskTierError. A child started early
    (`start_verify`) is collected; one that found damage is not trusted alone: it read
    before this process held the directory's lock, so the environment is read again.
    The scan a passing child wrote waits for `take_scan`."""
    key = os.path.realpath(path)
    child = _early.pop(key, None)
    if child is not None:
        try:
            return _verdict(path, child, timeout_s)
        except DiskTierDamaged:
            log.info("%s: damage found by the early read; reading it again under the lock", path)
    _verdict(path, _spawn(key), timeout_s)


def take_scan(path: str, last_txn_id: int) -> disk_scan.MetaScan | None:
    """The records the verification child scanned (disk_scan.load), if it read them in
    transaction `last_txn_id`, the environment's last now: nothing committed since. None
    otherwise (the caller scans): a scan is never trusted over the environment."""
    fd = _scans.pop(os.path.realpath(path), None)
    if fd is None:
        return None
    try:
        handed = disk_scan.load(fd)
    finally:
        os.close(fd)
    if handed is None or handed[1] != last_txn_id:
        return None
    return handed[0]


def drop_scan(path: str) -> None:
    """Free a scan nobody took (the tier closes without having scanned)."""
    fd = _scans.pop(os.path.realpath(path), None)
    if fd is not None:
        os.close(fd)


def _spawn(path: str) -> _Child:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    fd = os.memfd_create("hicache-disk-scan", os.MFD_CLOEXEC)
    proc = subprocess.Popen([sys.executable, "-m", "hicache.tiers.disk.env", path, str(fd)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL, pass_fds=(fd,))
    return _Child(proc, fd)


def _verdict(path: str, child: _Child, timeout_s: float) -> None:
    proc = child.proc
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise DiskTierDamaged(f"{path}: reading the environment did not finish in {timeout_s:.0f}s") from None
    except BaseException:
        os.close(child.scan_fd)
        raise
    if proc.returncode == 0:
        old = _scans.pop(os.path.realpath(path), None)
        if old is not None:
            os.close(old)
        _scans[os.path.realpath(path)] = child.scan_fd
        return
    os.close(child.scan_fd)
    lines = (stdout.strip() or stderr.strip()).splitlines()
    why = lines[-1] if lines else f"exit status {proc.returncode}"
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        raise DiskTierDamaged(f"{path}: reading the environment kills the reader ({sig}: {why})")
    if proc.returncode == _EXIT_DAMAGED:
        raise DiskTierDamaged(why)
    raise DiskTierError(f"{path}: cannot verify the environment: {why}")


def _scan(path: str, scan_fd: int | None = None) -> int:
    """What the child reads: every record the rebuild reads, and every page key (in C
    where the disk tier's library is usable: scan.py, which then writes what it read
    of the records to `scan_fd` for the daemon: the module docstring of scan.py)."""
    try:
        env = lmdb.open(path, readonly=True, create=False, max_dbs=8, lock=False)
    except DAMAGE_ERRORS as e:
        raise DiskTierDamaged(f"{path}: not a usable LMDB environment ({e})") from e
    try:
        with env.begin() as txn:
            if txn.stat()["entries"] == 0:
                return 0  # created, never written: inspect_env calls it fresh
        scanner = disk_scan.native_scanner(env)  # outside a transaction: it opens one of its own
        with env.begin() as txn:
            dbs = _hicache_dbs(env, txn, path)
            _, num_pages = fmt.unpack_totals(txn.get(fmt.INFO_TOTALS_KEY, db=dbs[fmt.DB_INFO]), path)
            if scanner is not None:
                n = scanner.count_keys(txn, fmt.DB_PAGES)
                if scan_fd is None:
                    return n + scanner.count_keys(txn, fmt.DB_META, read_values=True)
                scan = scanner.meta(txn, fmt.DB_META, num_pages)  # reads every record: the check of them too
                disk_scan.dump(scan, txn.id(), scan_fd)
                return n + len(scan) + scan.malformed
            n = 0
            for _key, value in txn.cursor(db=dbs[fmt.DB_META]):
                n += len(value) > 0
            for _key in txn.cursor(db=dbs[fmt.DB_PAGES]).iternext(keys=True, values=False):
                n += 1
            return n
    finally:
        env.close()


def _child_main(path: str, scan_fd: int | None) -> int:
    try:
        _scan(path, scan_fd)
    except DiskTierDamaged as e:
        print(e, flush=True)
        return _EXIT_DAMAGED
    except DAMAGE_ERRORS as e:
        print(f"{path}: damaged LMDB environment ({e})", flush=True)
        return _EXIT_DAMAGED
    except (lmdb.Error, OSError) as e:
        print(f"{path}: {e}", flush=True)
        return _EXIT_UNUSABLE
    return 0


# ------------------------------------------------------------------ open / quarantine


class OpenedEnv(NamedTuple):
    path: str
    env: lmdb.Environment
    lock_fd: int  # holds the directory's flock; close it to release
    map_size: int
    used_bytes: int
    num_pages: int


def reserve(data_file: str, nbytes: int) -> None:
    """Allocate the whole map up front: with writemap, a write into a sparse
    hole on a full disk is a SIGBUS; with the blocks reserved it cannot happen."""
    fd = os.open(data_file, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise DiskTierError(f"{data_file}: cannot reserve {nbytes} bytes for the LMDB map: "
                            f"{e.strerror or e}") from e
    finally:
        os.close(fd)


def open_environment(path: str, map_size: int, durability: str, *, reset: bool,
                     max_spare_txns: int) -> OpenedEnv:
    """The open protocol: lock the directory, optionally reset it, refuse a
    foreign, damaged or possibly torn environment WITHOUT writing to it, mark
    the state unclean, open LMDB (writemap), create the databases if fresh,
    clear stale readers and reserve the map on disk."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DiskTierError(f"{path}: exists and is not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise unusable(path, e) from e
    lock_fd = lock_dir(path)
    try:
        return _open_locked(path, lock_fd, map_size, durability, reset, max_spare_txns)
    except BaseException:
        os.close(lock_fd)
        raise


def _open_locked(path: str, lock_fd: int, map_size: int, durability: str, reset: bool,
                 max_spare_txns: int) -> OpenedEnv:
    data_file = os.path.join(path, "data.mdb")
    try:
        if reset:
            discard_verify(path)
            for name in fmt.ENV_FILES:
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
        size_before = os.path.getsize(data_file) if os.path.exists(data_file) else None
    except OSError as e:
        raise unusable(path, e) from e
    totals = None
    try:
        if size_before is not None:
            state = read_state(path)
            if size_before == 0:
                if state is not None:  # an environment was here: its data file was emptied
                    raise DiskTierDamaged(f"{path}: data.mdb is empty")
            else:
                if (state is not None and not state.get("clean", True) and state.get("durability") == "none"
                        and state.get("boot_id") and state.get("boot_id") != boot_id()):
                    raise DiskTierDamaged(f"{path}: the machine went down while this environment was open "
                                          "with durability='none'; it may be torn")
                verify(path)
                totals = inspect_env(path)
    finally:
        discard_verify(path)  # a child started early and not collected (refused before it)
    fresh = totals is None
    try:
        try:
            write_state(path, clean=False, durability=durability)
        except OSError as e:
            raise unusable(path, e) from e
        sync, metasync = fmt.SYNC_FLAGS[durability]
        try:
            env = lmdb.open(path, map_size=map_size, writemap=True, sync=sync, metasync=metasync,
                            max_dbs=4, max_readers=126, max_spare_txns=max_spare_txns,
                            readahead=True, meminit=False, mode=0o600)
        except DAMAGE_ERRORS as e:
            raise DiskTierDamaged(f"{path}: damaged LMDB environment ({e})") from e
        except lmdb.Error as e:
            raise DiskTierError(f"{path}: cannot open the LMDB environment: {e}") from e
        try:
            env.reader_check()  # clear reader slots left by dead processes
            if fresh:
                with env.begin(write=True) as txn:
                    for name in (fmt.DB_PAGES, fmt.DB_META):
                        env.open_db(name, txn=txn)
                    info = env.open_db(fmt.DB_INFO, txn=txn)
                    txn.put(fmt.INFO_FORMAT_KEY, fmt.pack_info(), db=info)
                    txn.put(fmt.INFO_TOTALS_KEY, fmt.pack_totals(0, 0), db=info)
                totals = (0, 0)
            real_map_size = env.info()["map_size"]  # LMDB raises it to the data size if smaller
            reserve(data_file, real_map_size)
            return OpenedEnv(path, env, lock_fd, real_map_size, totals[0], totals[1])
        except lmdb.Error as e:
            env.close()
            raise DiskTierError(f"{path}: cannot initialise the LMDB environment: {e}") from e
        except BaseException:
            env.close()
            raise
    except BaseException:
        _undo(path, data_file, fresh, size_before)
        raise


def _undo(path: str, data_file: str, fresh: bool, size_before: int | None) -> None:
    """After a failed open: remove what a fresh open created, or cut data.mdb back."""
    try:
        if fresh:
            for name in (*fmt.ENV_FILES, fmt.STATE_FILE + ".tmp"):
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
        elif size_before is not None and os.path.getsize(data_file) > size_before:
            os.truncate(data_file, size_before)  # the old pages all lie below the old size
    except OSError as e:
        log.warning("%s: could not clean up after a failed open: %s", path, e)


def quarantine(path: str) -> str:
    """Move a damaged environment directory aside, to a sibling named
    ``<name>.corrupt-<UTC time>`` (0700), and return its new path. Only the newest
    such copy is kept: an environment takes its whole capacity on disk, and a
    disk that keeps failing must not fill the filesystem with copies."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    lock_fd = lock_dir(path)  # refuses if its owner still has it open
    try:
        older = [e for e in os.listdir(parent) if e.startswith(name + QUARANTINE_TAG)]
        dest = os.path.join(parent, name + QUARANTINE_TAG + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        n, base = 0, dest
        while os.path.lexists(dest):
            n += 1
            dest = f"{base}-{n}"
        os.rename(path, dest)
        os.chmod(dest, 0o700)
        _fsync_dir(parent)
    except OSError as e:
        raise DiskTierError(f"{path}: cannot move the damaged environment aside: {e.strerror or e}") from e
    finally:
        os.close(lock_fd)
    for e in older:
        shutil.rmtree(os.path.join(parent, e), ignore_errors=True)
        log.info("removed an older quarantined disk tier %s", os.path.join(parent, e))
    return dest


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
