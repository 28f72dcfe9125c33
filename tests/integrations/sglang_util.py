"""Helpers for the SGLang backend tests: SGLang's real storage config, dynamic factory and
host pools (built on CPU by hicache.integrations.sglang_cpu), and page contents that a
process can regenerate from a seed to check another process's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str
except ImportError as e:  # CI must run these tests: a missing SGLang fails them there
    if os.environ.get("CI"):
        pytest.fail(f"sglang is not importable under CI ({e}); scripts/setup_sglang.sh installs it",
                    pytrace=False)
    pytest.skip(f"sglang is not installed ({e}); run scripts/setup_sglang.sh", allow_module_level=True)

from hicache.integrations.sglang_cpu import mha_host_pool, mla_host_pool

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
EXTRA = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStore",
         "interface_v1": 1}


def storage_config(socket: str, *, model: str | None = "tiny-llama", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, model_extra: str | None = None, **extra: Any) -> HiCacheStorageConfig:
    """`model` is what SGLang passes (its served model name); `model_extra` the extra-config "model"."""
    if model_extra is not None:
        extra["model"] = model_extra
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model,
                                extra_config={**EXTRA, "socket": socket, **extra})


def host_pool(kind: str = "mha", layout: str = "page_first", pages: int = 64) -> Any:
    if kind == "mha":
        return mha_host_pool(layers=3, heads=2, head_dim=32, page_size=PAGE_SIZE, pages=pages, layout=layout)
    return mla_host_pool(layers=3, kv_lora_rank=48, rope_dim=16, page_size=PAGE_SIZE, pages=pages, layout=layout)


def backend(socket: str, pool: Any, **cfg: Any) -> HiCacheStorage:
    """What SGLang's cache controller does: the dynamic factory, then register the host pool."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(socket, **cfg), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def page_keys(n: int, seed: int, prior: str | None = None) -> list[str]:
    """SGLang's own keys (chained SHA-256 of token ids) for n pages of a seeded prompt."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n * PAGE_SIZE,), generator=g).tolist()
    return get_hash_str(tokens, prior, page_size=PAGE_SIZE)


def page_bytes_of(pool: Any) -> int:
    return pool.get_data_page(0, flat=True).numel() * pool.get_data_page(0, flat=True).element_size()


def content(pool: Any, seed: int, i: int) -> torch.Tensor:
    """Page i of a seeded sequence, as the pool's flat data page (every bit pattern, NaNs too)."""
    g = torch.Generator().manual_seed(seed * 100003 + i)
    raw = torch.randint(0, 256, (page_bytes_of(pool),), generator=g, dtype=torch.uint8)
    return raw.view(pool.dtype)


def fill(pool: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Write seeded pages into the pool through SGLang's own page API."""
    for i, first in enumerate(host_indices[::PAGE_SIZE].tolist()):
        pool.set_from_flat_data_page(first, content(pool, seed, i))


def matches(pool: Any, host_indices: torch.Tensor, seed: int) -> list[bool]:
    """Per page: are the pool's bytes exactly the seeded page's?"""
    return [torch.equal(pool.get_data_page(first, flat=True).view(torch.uint8).reshape(-1),
                        content(pool, seed, i).view(torch.uint8))
            for i, first in enumerate(host_indices[::PAGE_SIZE].tolist())]


def run_instance(socket: str, *args: str, timeout_s: float = 240.0) -> dict:
    """Another SGLang instance: tests/integrations/sglang_worker.py in its own process."""
    out = subprocess.run([sys.executable, "-m", "tests.integrations.sglang_worker", socket, *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise AssertionError(f"worker {args} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
