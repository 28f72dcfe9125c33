"""Test stand-in for SGLang's kernel package on a CPU without its CPU build (source-only).

Only the two ops SGLang calls on CPU without AMX exist here, in plain torch; every other
name imports (SGLang imports many at module level) and fails when called, naming it (see ../sitecustomize.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, max_context_len: int) -> None:
    """req_to_token[req, start:end] = the request's slice of out_cache_loc, requests in order."""
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer (a raw pointer and its bytes per token slot): slot tgt = slot src."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    slots = int(max(int(tgt.max()), int(src.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(slots, int(stride))
        buf[tgt] = buf[src].clone()


def __getattr__(name: str) -> Any:
    """SGLang imports many CPU ops at module level; only calling one we lack is an error."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"sgl_kernel.{name}: not provided by hicache's CPU test stand-in "
                           f"(tests/integrations/sglang_standins); SGLang called a kernel it does not cover")

    missing.__name__ = name
    return missing
