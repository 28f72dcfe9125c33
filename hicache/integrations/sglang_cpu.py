"""SGLang's real host KV pools on a CPU-only machine, for hicache's tests and benchmarks.

The backend itself (hicache.integrations.sglang) imports only SGLang's storage
module, which imports cleanly next to a CPU torch. SGLang's host pools do not:
`sglang.srt.mem_cache.memory_pool_host` pulls in every model config, and two
multimodal ones import `torchvision.transforms` at module level. The only
torchvision on the package index is built against CUDA torch and fails to load
next to the CPU build (`operator torchvision::nms does not exist`), and a CPU
build is not published there. So, when torchvision cannot be imported, and
only then, `import_host_pools` puts a placeholder package in its place before
importing the pools: any *use* of it raises, its import succeeds. Nothing on
the KV path touches torchvision; on a GPU machine with a working torchvision
the placeholder is never installed.

The pools are built from SGLang's own buffer descriptions (MHABufferInfo /
MLABufferInfo, what a device pool hands its host pool) with `pin_memory=False`
(pinning needs CUDA).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch


class _Placeholder:
    """Stands for any torchvision attribute; using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not usable here (a placeholder; see "
                           f"hicache/integrations/sglang_cpu.py)")


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def getattr_(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Placeholder(f"{spec.name}.{attr}")

        mod.__getattr__ = getattr_  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _torchvision_loads() -> bool:
    try:
        import torchvision.transforms  # noqa: F401
        return True
    except Exception:  # missing, or a CUDA build next to a CPU torch (RuntimeError)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def install_torchvision_placeholder() -> None:
    """The placeholder, only when torchvision cannot be imported (also what a CPU SGLang
    server needs: its model configs import torchvision)."""
    if not _torchvision_loads() and not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
        # transformers decides once (cached) whether torchvision is there; ask before the
        # placeholder exists, so it keeps its own torchvision-free paths.
        from transformers.utils import import_utils
        import_utils.is_torchvision_available()
        sys.meta_path.append(_PlaceholderFinder())


def import_host_pools() -> tuple[type, type]:
    """(MHATokenToKVPoolHost, MLATokenToKVPoolHost), with the placeholder if it is needed."""
    install_torchvision_placeholder()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    return MHATokenToKVPoolHost, MLATokenToKVPoolHost


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(*, layers: int, heads: int, head_dim: int, page_size: int, pages: int, layout: str,
                  dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real SGLang MHA host pool of about `pages` pages, on CPU."""
    mha_cls, _ = import_host_pools()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    tokens = pages * page_size
    # the device pool's per-layer buffers (CPU here); the host pool copies nothing at construction
    k = [torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                         device=torch.device("cpu"))
    return mha_cls(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                   device_capacity_tokens=page_size, start_layer=0, end_layer=layers, host_token_capacity=tokens)


def mla_host_pool(*, layers: int, kv_lora_rank: int, rope_dim: int, page_size: int, pages: int, layout: str,
                  dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real SGLang MLA host pool of about `pages` pages, on CPU."""
    _, mla_cls = import_host_pools()
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

    tokens = pages * page_size
    width = kv_lora_rank + rope_dim
    kv = [torch.zeros(page_size, 1, width, dtype=dtype) for _ in range(layers)]
    info = MLABufferInfo(buffers=tuple(kv), data_ptrs=_ptrs(kv), layer_indices=tuple(range(layers)),
                         device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_lora_rank,
                         qk_rope_head_dim=rope_dim, kv_cache_dim=width, dtype=dtype, device=torch.device("cpu"))
    return mla_cls(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                   device_capacity_tokens=page_size, start_layer=0, end_layer=layers, target_layer_num=layers,
                   host_token_capacity=tokens)
