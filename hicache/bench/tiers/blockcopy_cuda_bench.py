"""`hicache bench blockcopy --device cuda`: the vLLM connector's CUDA block copies
against one contiguous copy of the same bytes.

Per-layer KV tensors on the GPU as vLLM 0.32's CUDA default stores them (a block
token-major, `[num_blocks, block_size, kv_heads, 2 * head_size]` in memory, handed
to connectors as the `[B, H, N, C]` view) and a real host arena, registered with
CUDA as the worker registers it. Per dtype and copy method (`BlockCopier`'s Triton
kernel, and the torch twin that stages through host memory, the worker's CUDA path
before the kernel): a save of every layer of N blocks at random ids into N random
host pages, and the same loaded back one `load_layer` per layer. The baseline is
one `copy_` of the same byte count between the registered arena and a device
buffer, in the same direction (the DMA engine at its best). Times are CUDA events
around each call on the current stream, candidate and baseline back to back, the
order alternating; `ratio` is the median of baseline time / candidate time.
Every method's pages are checked against the KV bytes before timing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from hicache.bench.report import row
from hicache.integrations.block_copy import BlockCopier, CopyMethod
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena

METHODS: tuple[CopyMethod, ...] = ("triton", "torch")


def _timed(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def _bench_dtype(dtype: str, args: argparse.Namespace, rng: np.random.Generator) -> list[dict]:
    layout = KVLayout("mha", args.layers, args.block_size, dtype, num_kv_heads=args.kv_heads,
                      head_dim=args.head_size)
    n = max(1, (args.target_mib << 20) // layout.page_bytes)
    num_blocks = n + max(1, n // 4)
    phys = (num_blocks, args.block_size, args.kv_heads, 2 * args.head_size)
    numel = int(np.prod(phys)) * layout.itemsize
    caches = [torch.randint(0, 256, (numel,), dtype=torch.uint8, device="cuda").view(getattr(torch, dtype))
              .view(phys).permute(0, 2, 1, 3) for _ in range(args.layers)]
    arena = HostArena.create(num_blocks * layout.page_bytes, mlock=False)
    arena.array.fill(0x5A)
    blocks = rng.choice(num_blocks, n, replace=False)
    pages = rng.choice(num_blocks, n, replace=False)
    moved = n * layout.page_bytes
    host_flat = torch.from_numpy(arena.array[:moved])
    dev_flat = torch.empty(moved, dtype=torch.uint8, device="cuda")
    fns: dict[str, Callable[[], None]] = {
        "base_save": lambda: host_flat.copy_(dev_flat, non_blocking=True),
        "base_load": lambda: dev_flat.copy_(host_flat, non_blocking=True)}
    copiers = []
    for method in METHODS:
        try:
            c = BlockCopier(caches, num_blocks, layout, arena, method=method)
        except Exception as e:  # noqa: BLE001 - a method that cannot run here gets no row
            print(f"blockcopy: {method} cannot run here: {e}")
            continue
        copiers.append(c)
        c.save(blocks, pages)
        torch.cuda.synchronize()
        for layer, v in enumerate(c.blocks):
            want = v.view(torch.uint8)[torch.from_numpy(blocks).cuda()].reshape(n, -1).cpu()
            if not torch.equal(c.host[torch.from_numpy(pages), layer], want):
                raise SystemExit(f"{method} save wrote wrong bytes (layer {layer}): not benchmarking it")
        fns[f"save_{method}"] = lambda c=c: c.save(blocks, pages)
        fns[f"load_{method}"] = lambda c=c: [c.load_layer(layer, blocks, pages) for layer in range(args.layers)]
    assert arena.cuda_registered
    groups = [["base_save"] + [k for k in fns if k.startswith("save_")],
              ["base_load"] + [k for k in fns if k.startswith("load_")]]
    times: dict[str, list[float]] = {k: [] for k in fns}
    try:
        for fn in fns.values():  # warm-up: kernel builds, first touch
            fn()
        torch.cuda.synchronize()
        for rep in range(args.repeats):
            for group in groups:
                for name in (group if rep % 2 == 0 else group[::-1]):
                    times[name].append(_timed(fns[name]))
    finally:
        del copiers, fns, host_flat
        arena.close()
    rows = []
    for kind, label in (("save", "save all layers"), ("load", "load per layer")):
        base = np.array(times[f"base_{kind}"])
        for method in METHODS:
            if f"{kind}_{method}" not in times:
                continue
            paired = base / np.array(times[f"{kind}_{method}"])
            rows.append(row(f"cuda {label} {dtype} {method}", moved / float(np.median(times[f"{kind}_{method}"]))
                            / 1e9, "GB/s", moved / float(np.median(base)) / 1e9, "contiguous copy",
                            ratio=round(float(np.median(paired)), 3), ratio_min=round(float(paired.min()), 3),
                            blocks=n, bytes=moved, repeats=args.repeats))
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("blockcopy --device cuda needs a CUDA device")
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for dtype in args.dtypes:
        rows += _bench_dtype(dtype, args, rng)
    return rows
