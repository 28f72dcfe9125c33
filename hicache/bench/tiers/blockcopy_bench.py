"""`hicache bench blockcopy`: the vLLM connector's block copies against a plain memory copy.

Per-layer KV tensors shaped as vLLM's CPU backend hands them to connectors,
`[num_blocks, kv_heads, block_size, 2 * head_size]`, and a real host arena.
For each dtype and copy method (`BlockCopier`'s native chunk copy and its
torch twin): a save (`BlockCopier.save`, every layer of N blocks at random,
non-consecutive ids into N random host pages) and the same blocks loaded back
one `load_layer` call per layer, N chosen so about `--target-mib` move. The
baseline is a memcpy (`ctypes.memmove`, glibc) of the same byte count between
ordinary memory and the arena, in the same direction and with the same number
of calls (one for a save, one per layer for a load), both sides written before
timing. The "first touch" rows save into a fresh mapping of the arena, as an
engine's first saves after it maps a daemon's slabs, against a memcpy into
another fresh mapping: both pay a page fault per 4 KiB.

Each repetition times each candidate and its baseline back to back, the order
alternating; `ratio` is the median over repetitions of baseline time /
candidate time (GB/s of the copy over GB/s of memcpy), `ratio_min` the worst.
Every method's pages are checked against the KV bytes before timing.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.bench.report import row
from hicache.integrations.block_copy import BlockCopier, CopyMethod
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena

METHODS: tuple[CopyMethod, ...] = ("native", "torch")


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _check_pages(copier: BlockCopier, blocks: np.ndarray, pages: np.ndarray) -> None:
    """The saved pages hold each block's bytes, layer after layer (else the numbers are void)."""
    for layer, v in enumerate(copier.blocks):
        want = v[torch.from_numpy(blocks)].reshape(len(blocks), -1).view(torch.uint8)
        if not torch.equal(copier.host[torch.from_numpy(pages), layer], want):
            raise SystemExit(f"{copier.method} save wrote wrong bytes (layer {layer}): not benchmarking it")


def _bench_dtype(dtype: str, args: argparse.Namespace, rng: np.random.Generator) -> list[dict]:
    layout = KVLayout("mha", args.layers, args.block_size, dtype, num_kv_heads=args.kv_heads,
                      head_dim=args.head_size)
    n = max(1, (args.target_mib << 20) // layout.page_bytes)
    num_blocks = n + max(1, n // 4)
    shape = (num_blocks, args.kv_heads, args.block_size, 2 * args.head_size)
    numel = int(np.prod(shape)) * layout.itemsize
    caches = [torch.randint(0, 256, (numel,), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
              for _ in range(args.layers)]  # random bytes: NaNs included, compared as bytes
    arena = HostArena.create(num_blocks * layout.page_bytes, mlock=False)
    arena.array.fill(0x5A)  # fault the shared pages in before timing, as a daemon's long-used arena is
    blocks = rng.choice(num_blocks, n, replace=False)
    pages = rng.choice(num_blocks, n, replace=False)
    moved = n * layout.page_bytes
    layer_bytes = n * layout.layer_page_bytes
    plain = torch.full((moved,), 7, dtype=torch.uint8)
    plain_at, arena_at = plain.data_ptr(), arena.address

    def base_save() -> None:
        ctypes.memmove(arena_at, plain_at, moved)

    def base_load() -> None:
        for layer in range(args.layers):
            ctypes.memmove(plain_at + layer * layer_bytes, arena_at + layer * layer_bytes, layer_bytes)

    fns: dict[str, Callable[[], None]] = {"base_save": base_save, "base_load": base_load}
    copiers = []
    for method in METHODS:
        c = BlockCopier(caches, num_blocks, layout, arena, method=method)
        if c.method != method:
            continue  # no native copier here: only the torch rows
        copiers.append(c)
        c.save(blocks, pages)
        _check_pages(c, blocks, pages)
        fns[f"save_{method}"] = lambda c=c: c.save(blocks, pages)
        fns[f"load_{method}"] = lambda c=c: [c.load_layer(layer, blocks, pages) for layer in range(args.layers)]
    groups = [["base_save"] + [k for k in fns if k.startswith("save_")],
              ["base_load"] + [k for k in fns if k.startswith("load_")]]
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {k: [] for k in fns}
    try:
        for fn in fns.values():  # warm-up: first touch, the native build
            fn()
        for rep in range(args.repeats):
            for group in groups:
                for name in (group if rep % 2 == 0 else group[::-1]):  # drift in load favours no side
                    times[name].append(_timed(fns[name]))
        if copiers and copiers[0].method == "native":
            times |= _first_touch(copiers[0], arena, plain_at, moved, blocks, pages, args.repeats)
    finally:
        torch.set_num_threads(prev_threads)
        del copiers, fns
        arena.close()
        gc.collect()

    rows = []
    for kind, label in (("save", "save all layers"), ("load", "load per layer"), ("fresh", "save, first touch")):
        if f"base_{kind}" not in times:
            continue
        base = np.array(times[f"base_{kind}"])
        for method in METHODS:
            if f"{kind}_{method}" not in times:
                continue
            cand = np.array(times[f"{kind}_{method}"])
            paired = base / cand
            rows.append(row(f"{label} {dtype} {method}", moved / float(np.median(cand)) / 1e9, "GB/s",
                            moved / float(np.median(base)) / 1e9, "memcpy",
                            ratio=round(float(np.median(paired)), 3), ratio_min=round(float(paired.min()), 3),
                            blocks=n, bytes=moved, repeats=args.repeats, torch_threads=args.threads,
                            note=f"worst repetition {paired.min():.3f}"))
    return rows


def _first_touch(copier: BlockCopier, arena: HostArena, plain_at: int, moved: int, blocks: np.ndarray,
                 pages: np.ndarray, repeats: int) -> dict[str, list[float]]:
    """A save and a memcpy each into a fresh mapping of the arena's (allocated) memory, as an
    engine's first saves after it maps the daemon's slabs: every 4 KiB page faults once."""
    out: dict[str, list[float]] = {"base_fresh": [], "fresh_native": []}
    for rep in range(repeats):
        for name in (("base_fresh", "fresh_native") if rep % 2 == 0 else ("fresh_native", "base_fresh")):
            fresh = HostArena.from_fd(arena.fd, arena.nbytes)
            try:
                if name == "base_fresh":
                    out[name].append(_timed(lambda: ctypes.memmove(fresh.address, plain_at, moved)))
                else:
                    copier.rebind(fresh)
                    out[name].append(_timed(lambda: copier.save(blocks, pages)))
                    copier.rebind(arena)  # drop the view of `fresh` before it is unmapped
            finally:
                fresh.close()
    return out


def run(args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for dtype in args.dtypes:
        rows += _bench_dtype(dtype, args, rng)
    return rows

