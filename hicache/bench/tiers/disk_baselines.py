"""What disk_bench (hicache/bench/tiers/disk_bench.py) sets the disk tier against,
and the tools both sides measure with.

The baselines: raw py-lmdb under the tier's flags and batch size (puts, warm and
cold gets), dd (a sequential read and an fdatasync'ed write of the same bytes),
and plain ``preadv`` at shuffled offsets, in runs, or in order (the device's rate
for the tier's access patterns). The tools: a wall + CPU clock, the ring of
destination pages reads land in, the page-cache eviction every cold read starts
from (no root: fsync + POSIX_FADV_DONTNEED, mincore for what stayed) and the
row every result is reported as. disk_bench's docstring says what each row
compares.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import shutil
import subprocess
import time

import lmdb
import numpy as np

SYNC_FLAGS = {"none": (False, False), "batch": (True, False), "sync": (True, True)}  # durability -> (sync, metasync)
GB = 1e9


def result_row(name: str, value: float, unit: str, baseline: float | None = None) -> dict:
    ratio = None if not baseline else round(value / baseline, 3)
    return {"name": name, "value": round(value, 4), "unit": unit,
            "baseline": None if baseline is None else round(baseline, 4), "ratio": ratio}


def fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def destination_ring(size: int, nbytes: int = 64 << 20) -> list[np.ndarray]:
    """Destination pages, touched once: reads land in distinct host pages, as in the arena."""
    outs = [np.empty(size, dtype=np.uint8) for _ in range(max(1, nbytes // size))]
    for o in outs:
        o.fill(0)
    return outs


class Clock:
    """Wall and process-CPU time of a section: on a shared machine the CPU time
    (all threads of this process) is far less sensitive to the neighbours."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def rates(self, nbytes: int) -> tuple[float, float]:
        return nbytes / self.wall / GB, nbytes / max(self.cpu, 1e-9) / GB


def raw_put_get(path: str, size: int, keys: list[bytes], shuffled: list[bytes], pages: list[np.ndarray],
                 map_size: int, durability: str, batch: int) -> tuple[tuple[float, float], ...]:
    """Raw py-lmdb under the tier's flags: batched puts into a fresh environment,
    delete all, batched puts again (reusing the freed pages), then warm gets."""
    sync, metasync = SYNC_FLAGS[durability]
    env = lmdb.open(path, map_size=map_size, writemap=True, sync=sync, metasync=metasync, max_dbs=4,
                    meminit=False)
    db = env.open_db(b"pages")

    def put_all() -> Clock:
        with Clock() as clock:
            for i in range(0, len(keys), batch):
                with env.begin(write=True, db=db) as txn:
                    for j in range(i, min(len(keys), i + batch)):
                        txn.put(keys[j], pages[j % len(pages)])
        return clock

    fresh = put_all()
    with env.begin(write=True, db=db) as txn:
        for k in keys:
            txn.delete(k)
    for i in range(2):  # LMDB reuses pages freed by transaction T from T+2 on
        with env.begin(write=True, db=db) as txn:
            txn.put(b"tick", bytes([i]))
    steady = put_all()
    outs = destination_ring(size)
    for _ in range(2):  # the first pass maps the pages, the second is timed
        with Clock() as get:
            for i, k in enumerate(shuffled):
                with env.begin(db=db, buffers=True) as txn:
                    np.copyto(outs[i % len(outs)], np.frombuffer(txn.get(k), dtype=np.uint8))
    env.close()
    n = len(keys) * size
    return fresh.rates(n), steady.rates(n), get.rates(n)


def raw_cold_get(path: str, size: int, keys: list[bytes]) -> tuple[float, float]:
    """GB/s of one pass after evicting the file (once the environment is open),
    and the fraction of the file still cached when the pass began."""
    env = lmdb.open(path, readonly=True, max_dbs=4, lock=False)
    db = env.open_db(b"pages", create=False)
    outs = destination_ring(size)
    resident = drop_cache(path)
    with Clock() as get:
        for i, k in enumerate(keys):
            with env.begin(db=db, buffers=True) as txn:
                np.copyto(outs[i % len(outs)], np.frombuffer(txn.get(k), dtype=np.uint8))
    env.close()
    return get.rates(len(keys) * size)[0], resident



def drop_cache(path: str) -> float:
    """Evict the environment's file from the page cache without root: fsync, then
    POSIX_FADV_DONTNEED (the file is closed: nothing maps it). The kernel may keep
    some pages; the fraction still resident is returned and reported. A virtual
    disk may still be cached by its host: "cold" is this kernel's view."""
    data = os.path.join(path, "data.mdb")
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(data)


def resident_fraction(path: str, nbytes: int | None = None) -> float:
    """Fraction of the first `nbytes` of `path` in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path) if nbytes is None else nbytes
    if size == 0:
        return 0.0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
            return sum(b & 1 for b in vec) / len(vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def dd_read(path: str, size: int, count: int) -> float:
    """GB/s of dd reading `count` blocks of `size` from `path` through the page cache,
    sequentially, right after the same eviction as the cold gets."""
    drop_cache(os.path.dirname(path))
    res = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={size}", f"count={count}"],
                         capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.eE+-]+) s", res.stderr)
    if not m:
        raise RuntimeError(f"cannot read dd's timing: {res.stderr.strip()}")
    return size * count / float(m.group(1)) / GB


def random_pread(path: str, size: int, count: int, run: int = 1) -> float:
    """GB/s of `count` reads of `size` bytes at shuffled `size`-aligned offsets of the
    first `count * size` bytes of `path`, one at a time, right after the same eviction:
    the device's rate for the tier's access pattern (dd reads the same bytes in order,
    so the kernel's readahead streams them). With `run` > 1, one ``preadv`` reads `run`
    consecutive pages at a time (the runs in shuffled order): the device's rate for the
    prefetch's pattern, chains of consecutive pages from shuffled places in the file."""
    drop_cache(os.path.dirname(path))
    runs = max(1, count // run)
    order = np.random.default_rng(2).permutation(runs)
    ring = destination_ring(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Clock() as clock:
            for i, j in enumerate(order.tolist()):
                os.preadv(fd, [ring[(i * run + k) % len(ring)] for k in range(run)], j * run * size)
    finally:
        os.close(fd)
    return clock.rates(runs * run * size)[0]


def seq_pread(path: str, size: int, count: int) -> float:
    """GB/s of `count` reads of `size` bytes from the start of `path`, in order, one at
    a time, into the same destination pages as the tier, right after the same eviction:
    what dd does, from this process (the kernel's readahead streams it)."""
    drop_cache(os.path.dirname(path))
    ring = destination_ring(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        with Clock() as clock:
            for i in range(count):
                os.preadv(fd, [ring[i % len(ring)]], i * size)
    finally:
        os.close(fd)
    return clock.rates(count * size)[0]


def dd_write(path: str, size: int, count: int) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={size}", f"count={count}",
                          "conv=fdatasync"], capture_output=True, text=True, check=True)
    dt = time.perf_counter() - t0
    m = re.search(r"copied, ([0-9.eE+-]+) s", res.stderr)
    secs = float(m.group(1)) if m else dt
    os.unlink(path)
    return size * count / secs / GB

