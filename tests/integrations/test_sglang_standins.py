"""The CPU stand-ins the SGLang server tests run with (tests/integrations/sglang_standins): the
ops they provide do what SGLang's kernels do, and anything else fails loudly when called."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

STANDINS = Path(__file__).resolve().parent / "sglang_standins"


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kernel_stand_ins_match_sglangs_semantics_and_refuse_the_rest():
    k = load("standin_sgl_kernel", STANDINS / "sgl_kernel" / "__init__.py")
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 4]), torch.tensor([4, 6]),
                                   torch.tensor([11, 12, 13, 21, 22]), 10)
    assert req_to_token[2, 1:4].tolist() == [11, 12, 13] and req_to_token[0, 4:6].tolist() == [21, 22]
    assert int(req_to_token.count_nonzero()) == 5
    bufs = [torch.arange(8 * 6, dtype=torch.float32).view(8, 6), torch.arange(8 * 3, dtype=torch.int16).view(8, 3)]
    want = [b.clone() for b in bufs]
    for w in want:
        w[[5, 6]] = w[[1, 2]]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([5, 6]), torch.tensor([1, 2]))
    assert all(torch.equal(b, w) for b, w in zip(bufs, want))
    with pytest.raises(RuntimeError, match="not provided by hicache's CPU test stand-in"):
        k.decode_attention_cpu(torch.zeros(1))  # imported at module level by SGLang, never called here


def test_the_direct_host_copy_stand_in_copies_the_indexed_tokens_and_the_rest_refuse():
    sys.modules.pop("sitecustomize_standin", None)
    site = load("sitecustomize_standin", STANDINS / "sitecustomize.py")
    try:
        src = [torch.randn(16, 2, 4), torch.randn(16, 2, 4)]
        dst = [torch.zeros(32, 2, 4), torch.zeros(32, 2, 4)]
        site.transfer_kv_direct(src, dst, torch.tensor([0, 1, 2, 3]), torch.tensor([20, 21, 22, 23]), page_size=4)
        assert all(torch.equal(d[20:24], s[0:4]) for s, d in zip(src, dst))
        assert all(int(d[:20].count_nonzero()) == 0 and int(d[24:].count_nonzero()) == 0 for d in dst)
        with pytest.raises(RuntimeError, match="not provided by hicache's CPU test stand-in"):
            site._unsupported("transfer_kv_per_layer")()
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "sitecustomize_standin"]
