"""Stand-ins for the pieces of SGLang 0.5.23 that have no CPU build, for hicache's server tests.

On PYTHONPATH only for the SGLang server a test starts (every process it spawns
imports this first). They replace SGLang's own device<->host plumbing, never
hicache's path, and fail loudly on anything they do not cover:

- `sgl_kernel` (next to this file): the two ops SGLang calls on CPU without AMX.
- The MHA host pool is built with `pin_memory=True`, which registers its buffer with
  CUDA (`pool_host/common.py`) and pins the pages it allocates later (the `file`
  backend's read buffers): here it is built with `pin_memory=False`.
- torchvision (imported by SGLang's model configs) has no build for a CPU torch on the
  registry: hicache.integrations.sglang_cpu's placeholder (any use raises).
- The host pool's `transfer_kv_direct` (the `direct` io backend's device<->host copy)
  is bound only on CUDA/HIP/XPU/NPU: here a per-layer indexed copy in torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

import torch

_PATCHED = {"sglang.srt.mem_cache.pool_host.mha"}


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor,
                       dst_indices: torch.Tensor, page_size: int) -> None:
    """dst[dst_indices] = src[src_indices], layer by layer (token-indexed, layer-first buffers)."""
    src_idx, dst_idx = src_indices.to(torch.int64).cpu(), dst_indices.to(torch.int64).cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_idx] = src[src_idx].to(dst.dtype)


def _unsupported(name: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{name}: not provided by hicache's CPU test stand-in (use --hicache-io-backend direct "
                           f"--hicache-mem-layout layer_first)")
    return fail


def _patch(module: Any) -> None:
    pool = module.MHATokenToKVPoolHost
    init = pool.__init__

    def unpinned_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > 5:  # pin_memory passed by position: not how SGLang 0.5.23 builds it
            raise RuntimeError("hicache's CPU test stand-in expects pin_memory as a keyword")
        init(self, *args, **{**kwargs, "pin_memory": False})

    pool.__init__ = unpinned_init
    module.transfer_kv_direct = transfer_kv_direct
    for name in ("transfer_kv_per_layer", "transfer_kv_all_layer", "transfer_kv_per_layer_pf_lf",
                 "transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_direct_pf_lf",
                 "transfer_kv_all_layer_direct_lf_pf"):
        setattr(module, name, _unsupported(name))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in _PATCHED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        assert spec is not None and spec.loader is not None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())

# SGLang's model configs import torchvision, which has no build for this CPU torch here
from hicache.integrations.sglang_cpu import install_torchvision_placeholder  # noqa: E402

install_torchvision_placeholder()
