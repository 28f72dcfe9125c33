"""Host arena <-> device pool copies on a GPU: every copy method against a
pinned contiguous copy and a per-page cudaMemcpyAsync loop, same run.

For each page size and page pattern ("scattered": random slots and pages, no
two consecutive; "runs": blocks of `run_pages` consecutive pairs in random
order), about `target_bytes` of pages move:

- load_per_layer: one `load_layer` call per layer (what the executor issues);
- backup_all_layer: one `backup` call.

Methods: the device's copy backend (Triton kernel on CUDA, memcpy on CPU), the
torch twin, DMA 2-D copies of every run (`dma_min_run_pages=1`), and the
per-page loop (one `cudaMemcpyAsync` per K/V chunk from a precomputed list, as
a C++ loop would issue them; `memmove` on CPU). Baseline: the same bytes as one
contiguous copy per layer (load) or one for everything (backup) between the
same pinned arena and the device. Each method is timed wall clock from a
synchronized start to a synchronized end, launches included; values are
medians over `repeats`, interleaved. Every method's result is checked byte for
byte against the source before its rows are reported.

    hicache bench transfer --device cuda [--page-sizes 16 64] [--repeats 20]

The same code runs on CPU pools (`run(device="cpu")`), which is how the tests
keep it working without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.bench.report import row
from hicache.kernels import copy as kcopy
from hicache.kernels import dma
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostKVCache

PATTERNS = ("scattered", "runs")


def page_pairs(pattern: str, n: int, host_slots: int, device_pages: int, run_pages: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`n` (host slot, device page) pairs: scattered (no consecutive pair) or in runs."""
    if pattern == "scattered":
        # Every other slot/page, shuffled: no two pairs can form a run.
        host = rng.permutation(np.arange(0, host_slots, 2))[:n]
        dev = rng.permutation(np.arange(1, device_pages + 1, 2))[:n]
        if len(host) < n or len(dev) < n:
            raise ValueError("scattered pairs need twice as many slots and pages as pairs")
        return host.astype(np.int64), dev.astype(np.int64)
    if pattern == "runs":
        blocks = -(-n // run_pages)
        order_h, order_d = rng.permutation(blocks), rng.permutation(blocks)
        within = np.arange(run_pages)
        host = (order_h[:, None] * run_pages + within).reshape(-1)[:n]
        dev = (1 + order_d[:, None] * run_pages + within).reshape(-1)[:n]
        if host.max() >= host_slots or dev.max() > device_pages:
            raise ValueError("not enough slots or pages for the runs")
        return host.astype(np.int64), dev.astype(np.int64)
    raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")


class _Clock:
    """Wall time of a call from a synchronized start to a synchronized end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], None]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def _chunk_loop(device: torch.device) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """One copy call per chunk: cudaMemcpyAsync on the current stream, or memmove."""
    if device.type == "cuda":
        rt = dma.cuda_runtime()

        def cuda_loop(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
            rt.memcpy_async(dst.tolist(), src.tolist(), nbytes.tolist(),
                            torch.cuda.current_stream(device).cuda_stream)
        return cuda_loop

    def cpu_loop(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        kcopy.memmove_all(src.tolist(), dst.tolist(), nbytes.tolist())
    return cpu_loop


def _fill_random(bufs: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=bufs[0].device).manual_seed(seed)
    for b in bufs:
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=b.device, generator=g))


def _bench_case(layout: KVLayout, pattern: str, device: torch.device, *, target_bytes: int, repeats: int,
                run_pages: int, rng: np.random.Generator) -> list[dict]:
    n = max(1, target_bytes // layout.page_bytes)
    slots = pages = 2 * n + run_pages  # room for the scattered pattern's gaps
    arena = HostArena.create(slots * layout.page_bytes, mlock=False)
    arena.array.fill(0)  # fault the pages in before timing
    src = DevicePool(layout, pages * layout.page_size, device=device)
    dst = DevicePool(layout, pages * layout.page_size, device=device)
    _fill_random(src.k_buffers + src.v_buffers, seed=int(rng.integers(1 << 30)))
    host, dev = page_pairs(pattern, n, slots, pages, run_pages, rng)
    moved = n * layout.page_bytes

    backend = HostKVCache(layout, arena, device=device)
    caches = {backend.backend or "backend": backend,
              "torch": HostKVCache(layout, arena, device=device, backend="torch"),
              "dma": HostKVCache(layout, arena, device=device, dma_min_run_pages=1)}
    backup_plans = {m: c.prepare(src, host, dev) for m, c in caches.items()}
    load_plans = {m: c.prepare(dst, host, dev) for m, c in caches.items()}

    # Per-page loop: the chunk lists a native loop would hold, built once.
    g, base = backend.geom, arena.address
    load_chunks = [kcopy.load_layer_chunks(base, *_layer_ptrs(dst, layer), host, dev, layer, g)
                   for layer in range(layout.num_layers)]
    backup_chunks = kcopy.backup_chunks(base, *_all_ptrs(src), host, dev, g)
    loop = _chunk_loop(device)

    # Contiguous baseline: the same bytes between the same arena and the device.
    arena_t = torch.from_numpy(arena.array[:moved])
    contig = torch.empty(moved, dtype=torch.uint8, device=device)
    per_layer = moved // layout.num_layers
    layer_pairs = [(contig[i * per_layer:(i + 1) * per_layer], arena_t[i * per_layer:(i + 1) * per_layer])
                   for i in range(layout.num_layers)]

    def load_fn(method: str) -> Callable[[], None]:
        def per_page() -> None:
            for chunks in load_chunks:
                loop(*chunks)

        def contiguous() -> None:
            for d, s in layer_pairs:
                d.copy_(s, non_blocking=True)

        def with_cache() -> None:
            for layer in range(layout.num_layers):
                caches[method].load_layer(load_plans[method], layer)

        return {"per_page_memcpy": per_page, "contiguous": contiguous}.get(method, with_cache)

    def backup_fn(method: str) -> Callable[[], None]:
        def per_page() -> None:
            loop(*backup_chunks)

        def contiguous() -> None:
            arena_t.copy_(contig, non_blocking=True)

        def with_cache() -> None:
            caches[method].backup(backup_plans[method])

        return {"per_page_memcpy": per_page, "contiguous": contiguous}.get(method, with_cache)

    methods = [*caches, "per_page_memcpy", "contiguous"]
    sample = np.linspace(0, n - 1, num=min(n, 4), dtype=np.int64)
    clock = _Clock(device)
    rows: list[dict] = []
    try:
        for op, make in (("backup_all_layer", backup_fn), ("load_per_layer", load_fn)):
            fns = {m: make(m) for m in methods}
            times: dict[str, list[float]] = {m: [] for m in methods}
            if op == "load_per_layer":  # the contiguous backup overwrote the slots
                caches["torch"].backup(backup_plans["torch"])
            for fn in fns.values():  # warm-up: kernel compilation, first touch
                clock.time(fn)
            for _ in range(repeats):
                for m, fn in fns.items():
                    if m == "contiguous":
                        times[m].append(clock.time(fn))
                    elif op == "backup_all_layer":
                        for i in sample.tolist():  # each method must write the sampled slots itself
                            arena.array[host[i] * layout.page_bytes:(host[i] + 1) * layout.page_bytes] = 0
                        times[m].append(clock.time(fn))
                        _check_backup(backend, src, host[sample], dev[sample], m)
                    else:
                        times[m].append(clock.time(fn))
                        _check_load(src, dst, dev, m)
            gbs = {m: moved / float(np.median(ts)) / 1e9 for m, ts in times.items()}
            for m in methods[:-1]:
                extra = {} if m == "per_page_memcpy" else {"vs_per_page": round(gbs[m] / gbs["per_page_memcpy"], 3)}
                rows.append(row(f"{op}_ps{layout.page_size}_{pattern}_{m}", round(gbs[m], 2), "GB/s",
                                baseline=round(gbs["contiguous"], 2), baseline_name="contiguous", **extra))
    finally:
        for c in caches.values():
            c.close()
        arena.close()  # unmapped once the views above are gone
    return rows


def _layer_ptrs(pool: DevicePool, layer: int) -> tuple[int, int | None]:
    return pool.k_buffers[layer].data_ptr(), pool.v_buffers[layer].data_ptr() if pool.v_buffers else None


def _all_ptrs(pool: DevicePool) -> tuple[np.ndarray, np.ndarray | None]:
    k = np.array([b.data_ptr() for b in pool.k_buffers], dtype=np.int64)
    v = np.array([b.data_ptr() for b in pool.v_buffers], dtype=np.int64) if pool.v_buffers else None
    return k, v


def _check_backup(cache: HostKVCache, src: DevicePool, host: np.ndarray, dev: np.ndarray, method: str) -> None:
    """Host slots `host` hold the source pages `dev`, page-first."""
    ps = src.page_size
    for i in range(len(host)):
        want = b"".join(buf[dev[i] * ps:(dev[i] + 1) * ps].view(torch.uint8).cpu().numpy().tobytes()
                        for layer in range(src.layout.num_layers)
                        for buf in ([src.k_buffers[layer]] + ([src.v_buffers[layer]] if src.v_buffers else [])))
        if cache.read_page(int(host[i])) != want:
            raise AssertionError(f"{method} backup wrote wrong bytes into host slot {host[i]}")


def _check_load(src: DevicePool, dst: DevicePool, dev: np.ndarray, method: str) -> None:
    """Every loaded page equals its source page, then the destination is cleared
    so the next method starts from zeros."""
    idx = torch.as_tensor(dev, device=src.device)
    ps = src.page_size
    for a, b in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
        pa = a.view(torch.uint8).reshape(-1, ps * a[0].numel() * a.element_size())[idx]
        pb = b.view(torch.uint8).reshape(-1, ps * b[0].numel() * b.element_size())[idx]
        if not torch.equal(pa, pb):
            raise AssertionError(f"{method} load put wrong bytes into the device pool")
        b.zero_()


def run(page_sizes: tuple[int, ...] = (16, 64), *, device: str = "cuda", patterns: tuple[str, ...] = PATTERNS,
        num_layers: int = 32, num_kv_heads: int = 8, head_dim: int = 128, dtype: str = "float16",
        target_bytes: int = 1 << 30, repeats: int = 20, run_pages: int = 64, seed: int = 0) -> list[dict]:
    """Rows per page size, pattern, op and method: GB/s, the contiguous copy as
    baseline, and (copy methods) `vs_per_page`, the ratio to the per-page loop."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hicache bench transfer --device cuda: no CUDA device here")
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for ps in page_sizes:
        layout = KVLayout("mha", num_layers, ps, dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)
        for pattern in patterns:
            rows += _bench_case(layout, pattern, dev, target_bytes=target_bytes, repeats=repeats,
                                run_pages=run_pages, rng=rng)
    return rows
