"""The host arena (one memfd shared mapping) and its page-slot allocator.

Torch-free on purpose: the daemon owns the arena and plans by page ids, and
never needs torch (importing it costs seconds and hundreds of MiB). Engines
view the same memory as KV pages through `hicache.tiers.host.HostKVCache`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource

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
_mlock_refusal_logged = False


class HostArena:
    """One memfd-backed shared mapping. Build with `create` or `from_fd`.

    `close()` unmaps at once when nothing else views the memory; while views made
    from `.array` (HostKVCache tensors, page memoryviews) are alive, the mapping
    stays until the last one is dropped, so a late reader never touches freed memory.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        """Map `nbytes` of `fd` and take ownership of the fd (prefer create / from_fd)."""
        self._fd = fd
        self.nbytes = nbytes
        self._mmap: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self.locked = False
        self.cuda_registered = False

    @classmethod
    def create(cls, nbytes: int, mlock: bool = True, name: str = "hicache-arena") -> HostArena:
        """A new zero-filled arena of `nbytes`; `mlock` is best effort (see `.locked`)."""
        _require_size(nbytes)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            arena = cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        if mlock:
            arena._mlock()
        return arena

    @classmethod
    def from_fd(cls, fd: int, nbytes: int) -> HostArena:
        """Map the arena behind `fd` (e.g. received with SCM_RIGHTS). The fd is
        duplicated; the caller keeps and closes its own."""
        _require_size(nbytes)
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise HiCacheError(f"arena fd {fd} holds {size} bytes, fewer than the {nbytes} expected")
        own = os.dup(fd)
        try:
            return cls(own, nbytes)
        except BaseException:
            os.close(own)
            raise

    @property
    def fd(self) -> int:
        self._check_open()
        return self._fd

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
        return int(self.array.ctypes.data)

    def _check_open(self) -> None:
        if self._array is None:
            raise HiCacheError("host arena is closed")

    def _mlock(self) -> None:
        global _mlock_refusal_logged
        if _libc.mlock(self.address, self.nbytes) == 0:
            self.locked = True
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
            raise OSError(err, f"mlock of the host arena failed: {os.strerror(err)}")
        if not _mlock_refusal_logged:
            _mlock_refusal_logged = True
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            log.info("host arena not locked in RAM (%s; RLIMIT_MEMLOCK=%s bytes, arena %d bytes); "
                     "raise LimitMEMLOCK to keep it from being swapped",
                     os.strerror(err), "unlimited" if soft == resource.RLIM_INFINITY else soft, self.nbytes)

    def register_cuda(self) -> None:
        """Pin the mapping for CUDA (cudaHostRegister) so device copies DMA from it and
        kernels address it directly. No-op without CUDA or when already registered."""
        self._check_open()
        if self.cuda_registered or not _torch().cuda.is_available():
            return
        # Portable | Mapped: every context may use it, and with unified addressing the
        # host address is the device address kernels read.
        rc = _torch().cuda.cudart().cudaHostRegister(self.address, self.nbytes, 3)
        if int(rc) != 0:
            raise HiCacheError(f"cudaHostRegister of the host arena failed with CUDA error {int(rc)}")
        self.cuda_registered = True

    def unregister_cuda(self) -> None:
        if not self.cuda_registered:
            return
        rc = _torch().cuda.cudart().cudaHostUnregister(self.address)
        self.cuda_registered = False
        if int(rc) != 0:
            log.warning("cudaHostUnregister of the host arena failed with CUDA error %d", int(rc))

    def close(self) -> None:
        """Unregister, unmap (now or when the last view goes) and close the fd. Idempotent."""
        if self._array is None:
            return
        self.unregister_cuda()
        self._array = None
        assert self._mmap is not None
        try:
            self._mmap.close()
        except BufferError:
            log.debug("host arena still viewed; it is unmapped when the last view is dropped")
        self._mmap = None
        os.close(self._fd)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_array", None) is not None:
            self.close()



def _require_size(nbytes: int) -> None:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise HiCacheError(f"arena size must be a positive int, got {nbytes!r}")


# ---------------------------------------------------------------------------
# Slot allocator
# ---------------------------------------------------------------------------

class HostSlotAllocator:
    """Hands out host page-slot ids `first .. first+count-1`.

    A numpy stack of free ids plus a used mask: alloc and free are vectorized and
    O(n) in the ids moved. Freed ids are reused first (warm memory). Not thread-safe
    (the daemon's event loop owns it).
    """

    def __init__(self, first: int, count: int) -> None:
        if first < 0 or count <= 0:
            raise HostCacheError(f"need first >= 0 and count > 0, got first={first} count={count}")
        self.first = first
        self.count = count
        # Top of the stack is the end of the array; the lowest ids come out first.
        self._stack = np.arange(first + count - 1, first - 1, -1, dtype=np.int64)
        self._top = count
        self._used = np.zeros(count, dtype=bool)

    def available(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free ids (ascending on a fresh allocator), or None with nothing taken."""
        if n < 0:
            raise HostCacheError(f"cannot allocate {n} slots")
        if n > self._top:
            return None
        ids = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._used[ids - self.first] = True
        return ids

    def free(self, ids: np.ndarray | list[int]) -> None:
        """Return ids; out-of-range, repeated or not-allocated ids raise and free nothing."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return
        rel = ids - self.first
        if rel.min() < 0 or rel.max() >= self.count:
            raise HostCacheError(f"slot ids outside [{self.first}, {self.first + self.count}): "
                                 f"{ids[(rel < 0) | (rel >= self.count)][:8].tolist()}")
        if len(np.unique(rel)) != len(rel):
            raise HostCacheError("slot ids repeated in one free")
        if not self._used[rel].all():
            raise HostCacheError(f"double free of slot ids {ids[~self._used[rel]][:8].tolist()}")
        self._used[rel] = False
        self._stack[self._top:self._top + len(ids)] = ids[::-1]
        self._top += len(ids)



def _torch():  # only engines on CUDA register the arena; the daemon never imports torch
    import torch

    return torch
