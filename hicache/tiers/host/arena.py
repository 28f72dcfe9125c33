"""The host arena (its page-slot allocator is in slots.py).

The arena is one reserved range of address space cut into equal *slabs*; each
slab is backed by its own memfd. The daemon backs every slab; an engine backs
only the slabs the daemon sends it (those holding its own namespace's pages)
and the rest of its range stays PROT_NONE. So a tenant can map, read or write
nothing of another tenant's KV, yet page ids keep one numbering (byte offset =
slot * page_bytes) and the copy kernels keep one base address.

Every slab memfd is sealed against shrinking and growing before any fd leaves
the daemon: a client that truncates its fd would otherwise make the daemon die
of SIGBUS on its next touch of that slab. When a slab leaves its owner the
daemon punches its memory out and backs the slab with a fresh memfd (a new
*generation*): an old mapping of the slab, in any process, never sees the next
owner's bytes.

Torch-free on purpose: the daemon owns the arena and plans by page ids, and
never needs torch (importing it costs seconds and hundreds of MiB). Engines
view the same memory as KV pages through `hicache.tiers.host.kv_cache.HostKVCache`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import resource
import threading
import weakref

import numpy as np

from hicache.errors import HiCacheError

log = logging.getLogger(__name__)


class HostCacheError(HiCacheError, ValueError):
    """Bad slot ids, page ids or page bytes given to the host tier (nothing changed)."""

# ---------------------------------------------------------------------------
# Arena
# ---------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
# Linux 5.14+; Python 3.11's mmap module lacks the names. Older kernels answer EINVAL.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_populate_supported = True
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_SLABS = 250  # slab fds travel in one SCM_RIGHTS message (the kernel's cap is 253)
_mlock_refusal_logged = False


def new_slab_memfd(nbytes: int, name: str = "hicache-slab") -> int:
    """A zero-filled memfd of `nbytes`, sealed so no holder can shrink or grow it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_fixed(addr: int, nbytes: int, fd: int) -> None:
    """Map `fd` shared, read-write, exactly at `addr` (replacing what was there)."""
    got = _libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got == _MAP_FAILED or got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping a host slab failed: {os.strerror(err)}")


def _reserve_fixed(addr: int, nbytes: int) -> None:
    """Put an inaccessible reservation back at `addr` (never leave a hole another mmap could take)."""
    got = _libc.mmap(addr, nbytes, _PROT_NONE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
    if got == _MAP_FAILED or got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"unmapping a host slab failed: {os.strerror(err)}")


class HostArena:
    """`num_slabs` slabs of `slab_bytes` in one reserved address range.

    Build with `create` (every slab backed: the daemon, tests), `reserve` (none
    backed: an engine, which `map_slab`s what the daemon sends it) or `from_fd`
    (a one-slab arena from a memfd, e.g. in a second process). Touching a slab
    that is not backed faults, so copies check `covers` first.

    `close()` unmaps at once when nothing else views the memory; while views made
    from `.array` (HostKVCache tensors, page memoryviews) are alive, the mapping
    stays until the last one is dropped, so a late reader never touches freed memory.
    """

    def __init__(self, num_slabs: int, slab_bytes: int, *, mlock: bool = False) -> None:
        """An arena with no slab backed yet (prefer create / reserve / from_fd)."""
        _require_size(slab_bytes)
        if not isinstance(num_slabs, int) or not 1 <= num_slabs <= MAX_SLABS:
            raise HiCacheError(f"an arena has 1..{MAX_SLABS} slabs, got {num_slabs!r}")
        if num_slabs > 1 and slab_bytes % mmap.PAGESIZE:
            raise HiCacheError(f"slabs must be a multiple of {mmap.PAGESIZE} bytes, got {slab_bytes}")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.nbytes = num_slabs * slab_bytes
        # Pre-faulting (see `prefault`): one background thread, started on first use.
        self._fault_lock = threading.Lock()  # held by a pre-fault; close() takes it before unmapping
        # Guards the queue only, never held across a pre-fault: a slab mapped (or taken) while
        # another is being pre-faulted must not wait for it (mapping 16 slabs otherwise waited
        # out ~15 slabs' pre-faults on the caller's thread).
        self._queue_lock = threading.Lock()
        self._fault_queue: queue.SimpleQueue[tuple[int, bool] | None] | None = None
        # CPUs the pre-fault thread runs on (None: those of the thread that started it). An
        # engine sets its copy threads' CPUs, so pre-faults stay off its forward pass's cores.
        self.prefault_cpus: set[int] | None = None
        self._fault_thread: threading.Thread | None = None
        span = -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        # The reservation costs address space only; slabs are mapped over it. Python's
        # mmap is asked for a writable mapping (its buffer is read-only otherwise), which
        # is then made inaccessible until a slab is mapped there.
        self._mmap: mmap.mmap | None = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        self._array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)[:self.nbytes]
        self._base = int(self._array.ctypes.data)
        _reserve_fixed(self._base, span)
        self._fds = [-1] * num_slabs  # memfds this arena keeps (the daemon's, to send them)
        self._gens = [0] * num_slabs  # 0: not backed
        self.backed = np.zeros(num_slabs, dtype=bool)
        self.mlock = mlock
        self.locked = mlock  # every backed slab mlocked (False once one is refused)
        self.cuda_registered = False
        self._cuda_slabs: set[int] = set()

    @classmethod
    def create(cls, nbytes: int, mlock: bool = True, name: str = "hicache-arena",
               slab_bytes: int | None = None) -> HostArena:
        """A new zero-filled arena of `nbytes`, every slab backed by its own sealed memfd.
        One slab unless `slab_bytes` is given; `mlock` is best effort (see `.locked`)."""
        _require_size(nbytes)
        slab_bytes = nbytes if slab_bytes is None else slab_bytes
        _require_size(slab_bytes)
        if nbytes % slab_bytes:
            raise HiCacheError(f"an arena of {nbytes} bytes is no whole number of {slab_bytes}-byte slabs")
        arena = cls(nbytes // slab_bytes, slab_bytes, mlock=mlock)
        try:
            for slab in range(arena.num_slabs):
                arena.back_slab(slab, name)
        except BaseException:
            arena.close()
            raise
        return arena

    @classmethod
    def reserve(cls, num_slabs: int, slab_bytes: int) -> HostArena:
        """An engine's view of a daemon's arena: the address range, no slab backed yet."""
        return cls(num_slabs, slab_bytes)

    @classmethod
    def from_fd(cls, fd: int, nbytes: int) -> HostArena:
        """Map the memfd of a one-slab arena (e.g. received with SCM_RIGHTS). The fd is
        duplicated; the caller keeps and closes its own."""
        _require_size(nbytes)
        arena = cls(1, nbytes)
        try:
            arena.map_slab(0, os.dup(fd), 1, keep_fd=True)
        except BaseException:
            arena.close()
            raise
        return arena

    # -- slabs -----------------------------------------------------------------------
    def slab_address(self, slab: int) -> int:
        return self._base + slab * self.slab_bytes

    def slab_fd(self, slab: int) -> int:
        self._check_open()
        if self._fds[slab] < 0:
            raise HiCacheError(f"slab {slab} has no descriptor here")
        return self._fds[slab]

    def slab_gen(self, slab: int) -> int:
        """The slab's generation: bumped each time the daemon backs it anew (0: not backed)."""
        return self._gens[slab]

    def back_slab(self, slab: int, name: str = "hicache-slab") -> int:
        """(The daemon) back `slab` with a fresh sealed memfd; the old one, if any, is
        punched out first, so every other mapping of it reads zeros from now on.
        Returns the new generation."""
        self._check_open()
        fd = new_slab_memfd(self.slab_bytes, name)
        old = self._fds[slab]
        if old >= 0:
            _punch(old, self.slab_bytes)
        try:
            self._map(slab, fd)
        except BaseException:
            os.close(fd)
            raise
        if old >= 0:
            os.close(old)
        self._fds[slab] = fd
        self._gens[slab] += 1
        if self.mlock:
            self._mlock_slab(slab)
        return self._gens[slab]

    def map_slab(self, slab: int, fd: int, gen: int, *, keep_fd: bool = False, prefault: bool = True) -> None:
        """(An engine) map a slab memfd the daemon sent, taking ownership of `fd`
        (closed once mapped unless `keep_fd`). Replaces an older generation. Not `prefault`:
        the caller queues the pre-fault itself once it has mapped all it maps now (an mmap
        waits for a pre-fault in progress, which holds the address space's lock)."""
        try:
            self._check_open()
            if not 0 <= slab < self.num_slabs:
                raise HiCacheError(f"slab {slab} is outside this arena's {self.num_slabs} slabs")
            size = os.fstat(fd).st_size
            if size < self.slab_bytes:
                raise HiCacheError(f"slab fd holds {size} bytes, fewer than the {self.slab_bytes} expected")
            self._map(slab, fd)
        except BaseException:
            os.close(fd)
            raise
        if self._fds[slab] >= 0:
            os.close(self._fds[slab])
        self._fds[slab] = fd if keep_fd else -1
        if not keep_fd:
            os.close(fd)
        self._gens[slab] = gen
        if prefault:
            self.prefault_async(slab)  # the engine's first copy into it must not fault per 4 KiB

    def unmap_slab(self, slab: int) -> None:
        """(An engine) drop a slab that is no longer ours; its range faults again."""
        self._check_open()
        if not self.backed[slab]:
            return
        self._unregister_slab(slab)
        with self._fault_lock:  # a pre-fault writes into the slab: it ends before the range goes
            _reserve_fixed(self.slab_address(slab), self.slab_bytes)
            self.backed[slab] = False
        self._gens[slab] = 0
        if self._fds[slab] >= 0:
            os.close(self._fds[slab])
            self._fds[slab] = -1

    def _map(self, slab: int, fd: int) -> None:
        self._unregister_slab(slab)
        _map_fixed(self.slab_address(slab), self.slab_bytes, fd)
        self.backed[slab] = True
        if self.cuda_registered:
            self._register_slab(slab)

    def prefault(self, slab: int, *, allocate: bool = False) -> bool:
        """Put backed slab `slab` into this process's page tables now, contents unchanged.
        A first write into a fresh mapping takes a page fault per 4 KiB otherwise.

        ``allocate`` (the daemon, whose memfd pages may not exist yet): MADV_POPULATE_WRITE,
        one fault and a zeroed page per 4 KiB. Else (an engine mapping pages the daemon
        allocated): MADV_POPULATE_READ, where fault-around maps 16 resident pages per fault,
        writable at once (a shared memfd mapping needs no write notification), then every
        page marked written (native `dirty_pages`), as a first write into a clean entry
        costs the CPU a slow assist. Measured (loaded 2-core VM, 256 MiB, 2 copy threads):
        a copy into the fresh mapping 150-260 ms (65536 faults); POPULATE_READ 20-37 ms,
        then a copy 28-48 ms against 18-28 ms into written pages; READ and dirty_pages
        25-35 ms, then 19-26 ms; POPULATE_WRITE 76-102 ms, then 21-25 ms.
        False where the kernel lacks it (before 5.14), or the slab is not backed."""
        global _populate_supported
        advice = MADV_POPULATE_WRITE if allocate else MADV_POPULATE_READ
        with self._fault_lock:  # unmap_slab and close take it: the slab stays mapped meanwhile
            if not _populate_supported or self._array is None or not self.backed[slab]:
                return False
            if _libc.madvise(self.slab_address(slab), self.slab_bytes, advice) == 0:
                if not allocate:
                    _dirty_pages(self.slab_address(slab), self.slab_bytes)
                return True
            err = ctypes.get_errno()
        if err == errno.EINVAL:
            _populate_supported = False
            log.info("this kernel cannot pre-fault host slabs (MADV_POPULATE_*: %s); the first "
                     "copy into a slab faults its pages in", os.strerror(err))
        else:  # ENOMEM (out of memory), EFAULT (a slab remapped meanwhile): the copy faults instead
            log.debug("pre-faulting host slab %d failed: %s", slab, os.strerror(err))
        return False

    def prefault_async(self, slab: int, *, allocate: bool = False) -> None:
        """`prefault` on this arena's background thread, off the caller's path (slabs in
        the order asked). A copy that gets there first faults as usual. Never waits for a
        pre-fault in progress."""
        with self._queue_lock:
            if self._array is None or not _populate_supported:
                return
            if self._fault_queue is None:
                self._fault_queue = queue.SimpleQueue()
                self._fault_thread = threading.Thread(target=_prefault_loop, name="hicache-prefault",
                                                      args=(weakref.ref(self), self._fault_queue), daemon=True)
                self._fault_thread.start()
            self._fault_queue.put((slab, allocate))

    def covers(self, slots: np.ndarray, page_bytes: int) -> bool:
        """Whether every page slot lies in a backed slab (so copies may touch it)."""
        if len(slots) == 0:
            return True
        slots = np.asarray(slots, dtype=np.int64)
        if slots.min() < 0 or (slots.max() + 1) * page_bytes > self.nbytes:
            return False
        first = (slots * page_bytes) // self.slab_bytes
        last = ((slots + 1) * page_bytes - 1) // self.slab_bytes
        return bool(self.backed[first].all() and self.backed[last].all())

    # -- views -----------------------------------------------------------------------
    @property
    def fd(self) -> int:
        """The memfd of a one-slab arena."""
        self._check_open()
        if self.num_slabs != 1:
            raise HiCacheError("a multi-slab arena has one descriptor per slab (slab_fd)")
        return self.slab_fd(0)

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def array(self) -> np.ndarray:
        """The whole arena as a numpy uint8 array (a view of the shared memory)."""
        self._check_open()
        assert self._array is not None
        return self._array

    @property
    def address(self) -> int:
        self._check_open()
        return self._base

    def _check_open(self) -> None:
        if self._array is None:
            raise HiCacheError("host arena is closed")

    def _mlock_slab(self, slab: int) -> None:
        global _mlock_refusal_logged
        if _libc.mlock(self.slab_address(slab), self.slab_bytes) == 0:
            return
        self.locked = False
        err = ctypes.get_errno()
        if err not in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
            raise OSError(err, f"mlock of the host arena failed: {os.strerror(err)}")
        if not _mlock_refusal_logged:
            _mlock_refusal_logged = True
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            log.info("host arena not locked in RAM (%s; RLIMIT_MEMLOCK=%s bytes, arena %d bytes); "
                     "raise LimitMEMLOCK to keep it from being swapped",
                     os.strerror(err), "unlimited" if soft == resource.RLIM_INFINITY else soft, self.nbytes)

    # -- CUDA ------------------------------------------------------------------------
    def register_cuda(self) -> None:
        """Pin the backed slabs for CUDA (cudaHostRegister) so device copies DMA from them
        and kernels address them directly; slabs mapped later are pinned as they come.
        No-op without CUDA or when already registered."""
        self._check_open()
        if self.cuda_registered or not _torch().cuda.is_available():
            return
        self.cuda_registered = True
        for slab in np.flatnonzero(self.backed):
            self._register_slab(int(slab))

    def _register_slab(self, slab: int) -> None:
        # Portable | Mapped: every context may use it, and with unified addressing the
        # host address is the device address kernels read.
        rc = _torch().cuda.cudart().cudaHostRegister(self.slab_address(slab), self.slab_bytes, 3)
        if int(rc) != 0:
            raise HiCacheError(f"cudaHostRegister of host slab {slab} failed with CUDA error {int(rc)}")
        self._cuda_slabs.add(slab)

    def _unregister_slab(self, slab: int) -> None:
        if slab not in self._cuda_slabs:
            return
        self._cuda_slabs.discard(slab)
        rc = _torch().cuda.cudart().cudaHostUnregister(self.slab_address(slab))
        if int(rc) != 0:
            log.warning("cudaHostUnregister of host slab %d failed with CUDA error %d", slab, int(rc))

    def unregister_cuda(self) -> None:
        for slab in list(self._cuda_slabs):
            self._unregister_slab(slab)
        self.cuda_registered = False

    def close(self) -> None:
        """Unregister, unmap (now or when the last view goes) and close the fds. Idempotent."""
        if self._array is None:
            return
        self.unregister_cuda()
        with self._fault_lock, self._queue_lock:  # a pre-fault in progress ends before the range goes
            self._array = None
            if self._fault_queue is not None:
                self._fault_queue.put(None)
            assert self._mmap is not None
            try:
                self._mmap.close()  # the whole range, slabs included
            except BufferError:
                log.debug("host arena still viewed; it is unmapped when the last view is dropped")
            self._mmap = None
        for i, fd in enumerate(self._fds):
            if fd >= 0:
                os.close(fd)
                self._fds[i] = -1

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_array", None) is not None:
            self.close()


def _prefault_loop(arena_ref: weakref.ref[HostArena], jobs: queue.SimpleQueue[tuple[int, bool] | None]) -> None:
    """The pre-fault thread: holds its arena only while working on a slab (a weak
    reference otherwise, so an arena nobody closes is still collected). Before each slab it
    moves to the arena's `prefault_cpus` if they changed."""
    placed: set[int] | None = None
    while (job := jobs.get()) is not None:
        arena = arena_ref()
        if arena is None:
            return
        want = arena.prefault_cpus
        if want and want != placed and hasattr(os, "sched_setaffinity"):
            placed = want
            try:
                os.sched_setaffinity(0, want)  # 0: this thread only
            except OSError as e:  # CPUs outside this process's cpuset: stay where it is
                log.info("pre-fault thread kept on CPUs %s (%s unusable: %s)",
                         sorted(os.sched_getaffinity(0)), sorted(want), e)
        arena.prefault(job[0], allocate=job[1])
        del arena


def _dirty_pages(address: int, nbytes: int) -> None:
    """Mark mapped pages written, bytes unchanged (`prefault`); nothing without the native
    library (imported here: the daemon never calls this, and builds nothing)."""
    from hicache.kernels import native_copy

    lib = native_copy.chunk_copy()
    if lib is not None:
        lib.dirty_pages(address, nbytes, mmap.PAGESIZE)


def _punch(fd: int, nbytes: int) -> None:
    """Free a memfd's memory now, whoever still maps it (they read zeros from then on)."""
    if _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, 0, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"punching out a host slab failed: {os.strerror(err)}")


def _require_size(nbytes: int) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise HiCacheError(f"arena size must be a positive int, got {nbytes!r}")


def _torch():  # only engines on CUDA register the arena; the daemon never imports torch
    import torch

    return torch
