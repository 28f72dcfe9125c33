"""Helpers shared by the page-copy tests: pools of random bytes, and compiling
Triton kernels for a CUDA target in a subprocess (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool

REPO = Path(__file__).resolve().parents[1]


def random_pool(layout: KVLayout, num_pages: int, seed: int, device: str = "cpu") -> DevicePool:
    """A pool whose every byte is random (generated on CPU, so every device gets the same bytes)."""
    pool = DevicePool(layout, num_pages * layout.page_size, device=device)
    g = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffers + pool.v_buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g).to(device))
    return pool


def run_triton_aot(code: str, cache_dir: Path) -> None:
    """Run `code` (which compiles kernels with triton.compile) in a fresh interpreter
    without TRITON_INTERPRET; skip where Triton or its NVIDIA backend is missing
    (the code exits 77 when this Triton lacks ASTSource/GPUTarget)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip("this triton has no ASTSource/GPUTarget")
    assert proc.returncode == 0, proc.stderr[-4000:]
