"""SGLang's L3 calls through hicache: batch_set_v1 / batch_get_v1 GB/s against a plain copy.

A real SGLang host pool (CPU, built by hicache.integrations.sglang_cpu) and a
real daemon (started here, host tier only, unless --socket names one). For
each host layout and page size, about `target_bytes` of seeded pages are
stored with batch_set_v1 (batches of 128 keys, as SGLang sends them) and read
back into other pool pages with batch_get_v1; every byte is checked before a
row is reported. Each call's time includes everything SGLang waits for: key
derivation, the round trips (store + store_done, fetch + release) and the
copies between the pool and the daemon's arena.

The host tier (a daemon per case, 4x the bytes of one repetition) fills during
the first repetitions, whose stores write arena pages this process has never
touched (a page fault per 4 KiB, reported as page_faults_per_mib); later ones
evict and reuse slots, as a long-running L3 does. batch_set_v1 is reported for
both phases.

Baseline, timed right before each candidate in the same repetition: one
contiguous torch `copy_` of the same byte count between ordinary memory and a
shared memfd mapping (what the arena is), in the same direction, same thread
count. Values are medians over `repeats`; ratio = candidate GB/s / baseline GB/s.

    hicache bench sglang [--page-sizes 16 64] [--layouts page_first layer_first] [--target-mib 256] [--repeats 9]
"""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hicache.bench.report import row
from hicache.tiers.host.arena import HostArena

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _config(socket: str, model: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model,
                                extra_config={"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                                              "class_name": "HiCacheStore", "interface_v1": 1, "socket": socket})


def _bench_case(socket: str, layout: str, page_size: int, *, layers: int, heads: int, head_dim: int,
                target_bytes: int, repeats: int, seed: int, capacity: int) -> list[dict]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from hicache.integrations.sglang_cpu import mha_host_pool

    page_bytes = layers * page_size * 2 * heads * head_dim * 2
    n = max(1, target_bytes // page_bytes)
    pool = mha_host_pool(layers=layers, heads=heads, head_dim=head_dim, page_size=page_size, pages=2 * n + 1,
                         layout=layout)
    b = StorageBackendFactory.create_backend("dynamic", _config(socket, f"bench-{layout}-{page_size}"), pool)
    b.register_mem_pool_host(pool)
    src, dst = pool.alloc(n * page_size), pool.alloc(n * page_size)
    gen = torch.Generator().manual_seed(seed)
    flat = [torch.randint(0, 256, (page_bytes,), generator=gen, dtype=torch.uint8) for _ in range(min(n, 8))]
    for i, first in enumerate(src[::page_size].tolist()):
        pool.set_from_flat_data_page(first, flat[i % len(flat)].view(pool.dtype))
    moved = n * page_bytes
    plain = torch.empty(moved, dtype=torch.uint8)
    plain.fill_(1)
    shared = HostArena.create(moved, mlock=False)
    shared.array.fill(2)  # fault the mapping in before timing
    shared_t = torch.from_numpy(shared.array[:moved])
    batches = [(lo, min(lo + BATCH, n)) for lo in range(0, n, BATCH)]
    set_s, get_s, set_base, get_base = [], [], [], []
    set_faults: list[int] = []
    get_faults = 0
    try:
        for rep in range(repeats):
            keys = [f"{seed:08x}{rep:08x}{i:048x}" for i in range(n)]  # fresh keys: every page is copied
            set_base.append(_timed(lambda: shared_t.copy_(plain))[0])
            f0 = _faults()
            t, oks = _timed(lambda: [ok for lo, hi in batches
                                     for ok in b.batch_set_v1(keys[lo:hi], src[lo * page_size:hi * page_size])])
            if not all(oks):
                raise RuntimeError(f"batch_set_v1 failed for {oks.count(False)} of {n} pages")
            set_s.append(t)
            set_faults.append(_faults() - f0)
            get_base.append(_timed(lambda: plain.copy_(shared_t))[0])
            f0 = _faults()
            t, oks = _timed(lambda: [ok for lo, hi in batches
                                     for ok in b.batch_get_v1(keys[lo:hi], dst[lo * page_size:hi * page_size])])
            if not all(oks):
                raise RuntimeError(f"batch_get_v1 missed {oks.count(False)} of {n} pages")
            get_s.append(t)
            get_faults += _faults() - f0
            for i in range(n):
                a = pool.get_data_page(int(src[i * page_size]), flat=True).view(torch.uint8)
                c = pool.get_data_page(int(dst[i * page_size]), flat=True).view(torch.uint8)
                if not torch.equal(a, c):
                    raise RuntimeError(f"page {i} differs after the round trip")
                pool.set_from_flat_data_page(int(dst[i * page_size]), torch.zeros_like(a).view(pool.dtype))
    finally:
        b.close()
        shared.close()
    gb = moved / 1e9
    mib = moved / (1 << 20)
    name = f"{layout} page {page_size} ({page_bytes >> 10} KiB pages, {n} pages)"
    # The first repetitions fill the host tier: the daemon hands out slots this process has
    # never touched, so each 4 KiB of them costs a page fault on first write. Once it is
    # full, stores evict and reuse slots (the steady state of a long-running L3).
    fill = max(1, min(repeats, capacity // moved))
    rows = [row(f"batch_set_v1 {name}, host tier filling", gb / _median(set_s[:fill]), "GB/s",
                gb / _median(set_base[:fill]), "plain copy_ into a memfd",
                page_faults_per_mib=round(sum(set_faults[:fill]) / (fill * mib), 1))]
    if repeats > fill:
        rows.append(row(f"batch_set_v1 {name}, host tier full", gb / _median(set_s[fill:]), "GB/s",
                        gb / _median(set_base[fill:]), "plain copy_ into a memfd",
                        page_faults_per_mib=round(sum(set_faults[fill:]) / ((repeats - fill) * mib), 1)))
    rows.append(row(f"batch_get_v1 {name}", gb / _median(get_s), "GB/s", gb / _median(get_base),
                    "plain copy_ from a memfd", page_faults_per_mib=round(get_faults / (repeats * mib), 1)))
    return rows


def run(socket_path: str | None, layouts: tuple[str, ...], page_sizes: tuple[int, ...], *, target_bytes: int,
        repeats: int, layers: int = 32, heads: int = 8, head_dim: int = 128) -> list[dict]:
    from hicache.daemon.serve.launcher import LocalDaemon

    # 4 repetitions fill the host tier: later ones evict, as a long-running L3 does (a power
    # of two, so the 64 slabs hold whole pages). A daemon per case (unless --socket): a case
    # must not pay for taking the previous case's slabs over.
    capacity = 1 << max(30, (4 * target_bytes - 1).bit_length())
    rows: list[dict] = []
    for layout in layouts:
        for ps in page_sizes:
            with tempfile.TemporaryDirectory() as tmp:
                daemon = None if socket_path else LocalDaemon(tmp, "--host-capacity", str(capacity),
                                                              "--no-disk").start()
                try:
                    rows += _bench_case(socket_path or daemon.socket, layout, ps, layers=layers, heads=heads,
                                        head_dim=head_dim, target_bytes=target_bytes, repeats=repeats,
                                        seed=len(rows), capacity=capacity)
                finally:
                    if daemon is not None:
                        daemon.stop()
    return rows
