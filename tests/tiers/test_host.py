"""Host tier: the memfd arena (shared with a second process), the slot
allocator, and HostKVCache copies (bytes survive device -> host -> device)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.errors import HiCacheError, LayoutError
from hicache.kernels import triton_env
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostCacheError, HostKVCache, HostSlotAllocator
from tests.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]
BACKENDS = ["memcpy", "torch"]


def mha(dtype: str = "float16", **kw) -> KVLayout:
    args = dict(num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, v_head_dim=4)
    args.update(kw)
    return KVLayout("mha", dtype=dtype, **args)


def mla(dtype: str = "float16", **kw) -> KVLayout:
    args = dict(num_layers=3, page_size=4, kv_lora_rank=16, qk_rope_head_dim=8)
    args.update(kw)
    return KVLayout("mla", dtype=dtype, **args)


def random_pool(layout: KVLayout, num_pages: int, seed: int) -> DevicePool:
    """A pool full of random bits, with all-ones rows (NaN in every float format)."""
    pool = DevicePool(layout, num_pages * layout.page_size)
    g = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffers + pool.v_buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        raw[::3] = 0xFF
    return pool


def page_bytes_of(pool: DevicePool, page: int) -> bytes:
    """The page-first host bytes a device page must become (the layout contract)."""
    ps = pool.page_size
    out = b""
    for layer in range(pool.layout.num_layers):
        out += pool.k_buffers[layer][page * ps:(page + 1) * ps].contiguous().view(torch.uint8).numpy().tobytes()
        if pool.layout.has_v:
            out += pool.v_buffers[layer][page * ps:(page + 1) * ps].contiguous().view(torch.uint8).numpy().tobytes()
    return out


def raw(pool: DevicePool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone() for b in pool.k_buffers + pool.v_buffers]


# ---------------------------------------------------------------------------
# Arena
# ---------------------------------------------------------------------------

def test_arena_create_views_and_close():
    arena = HostArena.create(10_000, mlock=False)
    assert arena.nbytes == 10_000 and arena.array.dtype == np.uint8 and arena.array.size == 10_000
    assert not arena.array.any()  # a fresh memfd reads as zeros
    assert os.fstat(arena.fd).st_size == 10_000
    arena.array[:3] = [1, 2, 3]
    fd = arena.fd
    arena.close()
    arena.close()  # idempotent
    assert arena.closed
    with pytest.raises(HiCacheError, match="closed"):
        arena.array
    with pytest.raises(HiCacheError, match="closed"):
        arena.fd
    with pytest.raises(OSError):
        os.fstat(fd)  # our fd is closed too


@pytest.mark.parametrize("nbytes", [0, -5, 1.5, True])
def test_arena_rejects_bad_sizes(nbytes):
    with pytest.raises(HiCacheError):
        HostArena.create(nbytes, mlock=False)


def test_arena_from_fd_checks_size():
    arena = HostArena.create(4096, mlock=False)
    with pytest.raises(HiCacheError, match="fewer"):
        HostArena.from_fd(arena.fd, 8192)
    other = HostArena.from_fd(arena.fd, 4096)
    assert other.fd != arena.fd  # duplicated, independently closable
    other.array[100] = 7
    assert arena.array[100] == 7  # same memory
    other.close()
    assert arena.array[100] == 7
    arena.close()


def test_arena_close_with_live_views_keeps_memory_valid():
    arena = HostArena.create(1 << 16, mlock=False)
    cache = HostKVCache(mha(), arena)
    view = cache.page_view(1)
    arena.close()  # views alive: unmapped later, never under a reader
    assert bytes(view[:4]) == b"\0\0\0\0"
    with pytest.raises(HiCacheError, match="closed"):
        cache.read_page(0)
    with pytest.raises(HiCacheError, match="closed"):
        cache.load_to_device_per_layer(DevicePool(mha(), 16), [0], [1], 0)


def test_arena_mlock_locks_when_allowed():
    arena = HostArena.create(1 << 16, mlock=True)
    if arena.locked:
        locked_kb = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                             if line.startswith("VmLck:")).split()[1])
        assert locked_kb * 1024 >= arena.nbytes
    arena.close()


_MLOCK_REFUSED = textwrap.dedent("""
    import ctypes, logging, resource, sys
    # Drop CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK with it) and forbid locking.
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(hdr), data) == 0
    data[0].effective &= ~(1 << 14)
    data[0].permitted &= ~(1 << 14)
    assert libc.capset(ctypes.byref(hdr), data) == 0
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    from hicache.tiers.host.kv_cache import HostArena
    a = HostArena.create(1 << 20, mlock=True)
    b = HostArena.create(1 << 20, mlock=True)
    a.array[:] = 1  # usable all the same
    print("LOCKED", a.locked, b.locked)
""")


def test_arena_mlock_refusal_is_logged_once_and_not_fatal():
    proc = subprocess.run([sys.executable, "-c", _MLOCK_REFUSED], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "LOCKED False False" in proc.stdout
    assert proc.stdout.count("INFO host arena not locked") == 1, proc.stdout


_CHILD = textwrap.dedent("""
    import hashlib, sys
    from hicache.layout import KVLayout
    from hicache.tiers.host.kv_cache import HostArena, HostKVCache
    fd, nbytes, digest = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    layout = KVLayout("mha", 3, 4, "bfloat16", num_kv_heads=2, head_dim=8, v_head_dim=4)
    arena = HostArena.from_fd(fd, nbytes)
    cache = HostKVCache(layout, arena)
    assert hashlib.sha256(cache.read_page(2)).hexdigest() == digest, "child sees other bytes"
    cache.write_page(5, bytes(range(256)) * (layout.page_bytes // 256) + b"\\x2a" * (layout.page_bytes % 256))
    print("CHILD OK")
""")


def _minor_faults() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_prefault_maps_an_engines_slab_without_a_fault_per_page_and_keeps_its_bytes():
    slab = 1 << 20
    daemon = HostArena.create(2 * slab, mlock=False, slab_bytes=slab)
    assert daemon.prefault(0, allocate=True)  # allocates: contents stay what they were
    assert not daemon.array[:slab].any()
    daemon.array[:2 * slab] = np.arange(2 * slab, dtype=np.uint64).astype(np.uint8)
    engine = HostArena.reserve(2, slab)
    assert not engine.prefault(0)  # not backed here: nothing to map
    engine.map_slab(0, os.dup(daemon.slab_fd(0)), daemon.slab_gen(0))
    assert engine.prefault(0)  # (map_slab queued it too; a second pass is harmless)
    before = _minor_faults()
    view = engine.array[:slab]
    view[::4096] += 1  # one write per 4 KiB page: each would fault in an unpopulated mapping
    assert _minor_faults() - before < slab // 4096 // 4
    assert np.array_equal(daemon.array[:slab], (np.arange(slab, dtype=np.uint64).astype(np.uint8)
                                                + (np.arange(slab) % 4096 == 0)).astype(np.uint8))
    engine.close()
    daemon.close()


def test_queueing_a_prefault_never_waits_for_one_in_progress():
    """A slab mapped while another is being pre-faulted (which holds the arena's fault
    lock for the whole madvise) is queued at once, not after that pre-fault."""
    daemon = HostArena.create(2 << 20, mlock=False, slab_bytes=1 << 20)
    engine = HostArena.reserve(2, 1 << 20)
    for s in range(2):
        engine.map_slab(s, os.dup(daemon.slab_fd(s)), daemon.slab_gen(s), prefault=False)
    with engine._fault_lock:  # as the pre-fault thread holds it during a madvise
        queued = threading.Thread(target=lambda: [engine.prefault_async(s) for s in range(2)])
        queued.start()
        queued.join(10)
        assert not queued.is_alive()
    engine.close()
    daemon.close()


def test_the_prefault_thread_moves_to_the_cpus_it_is_given():
    """An engine gives its arena its copy threads' CPUs: the pre-fault thread runs there
    from its next slab on, not on the cores of whichever thread started it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell a move from staying put")
    daemon = HostArena.create(2 << 20, mlock=False, slab_bytes=1 << 20)
    engine = HostArena.reserve(2, 1 << 20)
    engine.map_slab(0, os.dup(daemon.slab_fd(0)), daemon.slab_gen(0), prefault=False)
    engine.prefault_cpus = {cpus[-1]}
    engine.prefault_async(0)
    thread = engine._fault_thread
    assert thread is not None
    wait_until(lambda: thread.native_id is not None and os.sched_getaffinity(thread.native_id) == {cpus[-1]},
               what="the pre-fault thread on the CPU given")
    engine.close()
    daemon.close()


def test_prefault_async_is_harmless_around_unmap_and_close():
    slab = 1 << 20
    daemon = HostArena.create(2 * slab, mlock=False, slab_bytes=slab)
    daemon.array[:] = 7
    engine = HostArena.reserve(2, slab)
    for s in (0, 1):
        engine.map_slab(s, os.dup(daemon.slab_fd(s)), daemon.slab_gen(s))
    engine.unmap_slab(1)  # its queued pre-fault finds it gone
    engine.prefault_async(0)
    engine.close()  # waits for a pre-fault in progress, then unmaps
    engine.prefault_async(0)  # after close: nothing happens
    assert not engine.prefault(0)
    assert (daemon.array == 7).all()
    daemon.close()


def test_second_process_shares_the_arena():
    layout = mha("bfloat16")
    arena = HostArena.create(8 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    pool = random_pool(layout, 8, seed=1)
    cache.backup_from_device_all_layer(pool, [2], [3])
    digest = hashlib.sha256(page_bytes_of(pool, 3)).hexdigest()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(arena.fd), str(arena.nbytes), digest],
                          pass_fds=(arena.fd,), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "CHILD OK" in proc.stdout, proc.stderr
    # What the child wrote is visible here, and loads into a device pool.
    want = bytes(range(256)) * (layout.page_bytes // 256) + b"\x2a" * (layout.page_bytes % 256)
    assert cache.read_page(5) == want
    target = DevicePool(layout, 8 * layout.page_size)
    for layer in range(layout.num_layers):
        cache.load_to_device_per_layer(target, [5], [6], layer)
    assert page_bytes_of(target, 6) == want
    arena.close()


# ---------------------------------------------------------------------------
# Slot allocator
# ---------------------------------------------------------------------------

def test_slot_allocator_alloc_free_reuse():
    a = HostSlotAllocator(10, 5)
    assert a.available() == 5
    got = a.alloc(3)
    assert got.dtype == np.int64 and got.tolist() == [10, 11, 12]
    assert a.available() == 2
    assert a.alloc(3) is None and a.available() == 2  # short: nothing taken
    a.free(np.array([11]))
    assert a.alloc(3).tolist() == [11, 13, 14]  # freed ids first
    assert a.alloc(1) is None
    a.free([10, 12, 11, 13, 14])
    assert a.available() == 5
    assert sorted(a.alloc(5).tolist()) == list(range(10, 15))
    assert a.alloc(0).tolist() == []


@pytest.mark.parametrize("bad", [[9], [15], [12, 12], [13]])
def test_slot_allocator_rejects_bad_free_and_changes_nothing(bad):
    a = HostSlotAllocator(10, 5)
    a.alloc(3)  # 10, 11, 12 in use; 13, 14 free
    with pytest.raises(HostCacheError):
        a.free([11] + bad)  # a valid id alongside the bad ones is not freed either
    assert a.available() == 2
    with pytest.raises(ValueError):  # HostCacheError is a ValueError
        a.free([11, 11])
    a.free([10, 11, 12])
    assert a.available() == 5
    with pytest.raises(HostCacheError, match="double free"):
        a.free([10])


def test_slot_allocator_bad_construction():
    with pytest.raises(HostCacheError):
        HostSlotAllocator(0, 0)
    with pytest.raises(HostCacheError):
        HostSlotAllocator(-1, 4)


# ---------------------------------------------------------------------------
# HostKVCache copies
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make_layout", [mha, mla], ids=["mha", "mla"])
def test_roundtrip_device_host_device_keeps_every_byte(make_layout, dtype, backend):
    layout = make_layout(dtype)
    src = random_pool(layout, 12, seed=hash((dtype, layout.kind)) % 1000)
    arena = HostArena.create(9 * layout.page_bytes + 100, mlock=False)  # tail smaller than a page
    cache = HostKVCache(layout, arena, backend=backend)
    assert cache.num_slots == 9
    host, dev = [7, 0, 3, 4, 8], [2, 11, 5, 6, 12]
    cache.backup_from_device_all_layer(src, torch.tensor(host), np.array(dev))
    assert cache.backend == backend and cache.device == torch.device("cpu")
    for h, d in zip(host, dev):
        assert cache.read_page(h) == page_bytes_of(src, d)  # page-first layout, exactly
    for h in set(range(9)) - set(host):
        assert not any(cache.read_page(h))  # nothing else written
    dst = DevicePool(layout, 12 * layout.page_size)
    back = [1, 9, 10, 3, 4]
    for layer in range(layout.num_layers):
        cache.load_to_device_per_layer(dst, host, back, layer)
    for d_src, d_dst in zip(dev, back):
        for a, b in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
            ps = layout.page_size
            assert torch.equal(a[d_src * ps:(d_src + 1) * ps].view(torch.uint8),
                               b[d_dst * ps:(d_dst + 1) * ps].view(torch.uint8))
    untouched = [p for p in range(13) if p not in back]
    ps = layout.page_size
    for b in dst.k_buffers + dst.v_buffers:
        assert not b.view(torch.uint8).reshape(13, -1)[untouched].any()
    cache.close()
    arena.close()


def test_per_layer_load_touches_only_that_layer():
    layout = mha()
    src = random_pool(layout, 4, seed=3)
    arena = HostArena.create(4 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    cache.backup_from_device_all_layer(src, [0, 1], [1, 2])
    dst = DevicePool(layout, 4 * layout.page_size)
    cache.load_to_device_per_layer(dst, [0, 1], [1, 2], 1)
    assert dst.k_buffers[1].view(torch.uint8).any() and dst.v_buffers[1].view(torch.uint8).any()
    for layer in (0, 2):
        assert not dst.k_buffers[layer].view(torch.uint8).any()
        assert not dst.v_buffers[layer].view(torch.uint8).any()
    arena.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_chunk_sizes_use_narrow_views(backend):
    # 3 fp8 elements per token: chunks of odd byte size, copied through uint8 views.
    layout = KVLayout("mha", 2, 3, "float8_e4m3fn", num_kv_heads=1, head_dim=3, v_head_dim=5)
    src = random_pool(layout, 6, seed=4)
    arena = HostArena.create(6 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena, backend=backend)
    assert cache.geom.width == 1
    cache.backup_from_device_all_layer(src, [5, 1, 2], [1, 2, 3])  # consecutive device pages
    assert [cache.read_page(h) for h in (5, 1, 2)] == [page_bytes_of(src, d) for d in (1, 2, 3)]
    dst = DevicePool(layout, 6 * layout.page_size)
    for layer in range(2):
        cache.load_to_device_per_layer(dst, [5, 1, 2], [4, 5, 6], layer)
    assert [page_bytes_of(dst, d) for d in (4, 5, 6)] == [page_bytes_of(src, d) for d in (1, 2, 3)]
    arena.close()


def test_single_layer_mla_runs_coalesce_into_one_copy():
    # With one layer a host page is one chunk: consecutive host+device pages merge.
    layout = mla(num_layers=1)
    src = random_pool(layout, 10, seed=5)
    arena = HostArena.create(10 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    cache.backup_from_device_all_layer(src, [2, 3, 4, 7, 0], [5, 6, 7, 1, 2])
    assert [cache.read_page(h) for h in (2, 3, 4, 7, 0)] == [page_bytes_of(src, d) for d in (5, 6, 7, 1, 2)]
    dst = DevicePool(layout, 10 * layout.page_size)
    cache.load_to_device_per_layer(dst, [2, 3, 4, 7, 0], [8, 9, 10, 1, 2], 0)
    assert [page_bytes_of(dst, d) for d in (8, 9, 10, 1, 2)] == [page_bytes_of(src, d) for d in (5, 6, 7, 1, 2)]
    arena.close()


@pytest.mark.parametrize("host, dev, layer, err", [
    ([0, 9], [1, 2], 0, HostCacheError),   # host slot past the end
    ([-1], [1], 0, HostCacheError),
    ([0], [0], 0, HostCacheError),         # device page 0 is padding
    ([0], [9], 0, HostCacheError),         # past the pool
    ([0, 1], [1], 0, HostCacheError),      # length mismatch
    ([0, 1], [2, 2], 0, HostCacheError),   # repeated destination
    ([[0]], [[1]], 0, HostCacheError),     # not 1-D
    ([0.5], [1], 0, HostCacheError),       # not integers
    ([0], [1], 3, HostCacheError),         # no such layer
    ([0], [1], -1, HostCacheError),
])
def test_bad_indices_rejected_and_nothing_changes(host, dev, layer, err):
    layout = mha()
    pool = random_pool(layout, 8, seed=6)
    arena = HostArena.create(9 * layout.page_bytes, mlock=False)
    arena.array[:] = np.random.default_rng(0).integers(0, 256, arena.nbytes, dtype=np.uint8)
    cache = HostKVCache(layout, arena)
    before_host = arena.array.copy()
    before_dev = raw(pool)
    with pytest.raises(err):
        cache.load_to_device_per_layer(pool, host, dev, layer)
    if layer == 0:
        with pytest.raises(err):
            cache.backup_from_device_all_layer(pool, host, dev)
    assert np.array_equal(arena.array, before_host)
    assert all(torch.equal(a, b) for a, b in zip(before_dev, raw(pool)))
    arena.close()


def test_pool_of_another_layout_is_rejected():
    arena = HostArena.create(4 * mha().page_bytes, mlock=False)
    cache = HostKVCache(mha(), arena)
    with pytest.raises(LayoutError):
        cache.backup_from_device_all_layer(DevicePool(mha("bfloat16"), 16), [0], [1])
    arena.close()


def test_empty_transfers_are_no_ops():
    layout = mha()
    arena = HostArena.create(2 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    pool = random_pool(layout, 2, seed=7)
    cache.backup_from_device_all_layer(pool, [], [])
    cache.load_to_device_per_layer(pool, np.empty(0, np.int64), torch.empty(0, dtype=torch.int64), 0)
    assert not arena.array.any()
    arena.close()


def test_arena_too_small_for_a_page():
    arena = HostArena.create(100, mlock=False)
    with pytest.raises(LayoutError):
        HostKVCache(mha(), arena)
    arena.close()


def test_backend_is_picked_once_from_the_first_pool():
    arena = HostArena.create(2 * mha().page_bytes, mlock=False)
    cache = HostKVCache(mha(), arena)
    assert cache.backend is None
    cache.backup_from_device_all_layer(DevicePool(mha(), 8), [0], [1])
    assert cache.backend == "memcpy" and cache.device.type == "cpu"
    assert HostKVCache(mha(), arena, device="cpu").backend == "memcpy"
    arena.close()


def test_unknown_or_unusable_backend():
    arena = HostArena.create(mha().page_bytes, mlock=False)
    with pytest.raises(LayoutError):
        HostKVCache(mha(), arena, backend="nope")
    with pytest.raises(LayoutError):
        HostKVCache(mha(), arena, device="cpu", backend="memcpy").prepare(DevicePool(mha(), 8, device="meta"), [0], [1])
    if not triton_env.interpreter_enabled():
        with pytest.raises(LayoutError):  # no Triton kernels for CPU tensors outside the interpreter
            HostKVCache(mha(), arena, device="cpu", backend="triton")
        cache = HostKVCache(mha(), arena, backend="triton")
        with pytest.raises(LayoutError):
            cache.backup_from_device_all_layer(DevicePool(mha(), 8), [0], [1])
        assert cache.backend is None  # nothing bound by the failed first use
    arena.close()


# ---------------------------------------------------------------------------
# Whole pages
# ---------------------------------------------------------------------------

def test_read_write_page_and_page_view():
    layout = mha()
    arena = HostArena.create(3 * layout.page_bytes, mlock=False)
    cache = HostKVCache(layout, arena)
    data = np.random.default_rng(1).integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes()
    cache.write_page(1, data)
    assert cache.read_page(1) == data
    assert bytes(cache.page_view(1)) == data
    assert not any(cache.read_page(0)) and not any(cache.read_page(2))
    view = cache.page_view(2)
    view[:3] = b"abc"  # writable, in place
    assert cache.read_page(2)[:3] == b"abc"
    cache.write_page(0, memoryview(bytearray(data)))
    assert cache.read_page(0) == data
    for bad_slot in (-1, 3, True, 1.0):
        with pytest.raises(HostCacheError):
            cache.read_page(bad_slot)
    for bad in (data[:-1], data + b"x", b""):
        with pytest.raises(HostCacheError):
            cache.write_page(1, bad)
    assert cache.read_page(1) == data
    arena.close()
