"""`hicache bench blockcopy` through the command line, on a tiny KV shape: its rows,
both copy methods, paired ratios to memcpy (performance is not asserted); on CUDA
(`gpu`), the triton and torch rows against a contiguous copy."""

from __future__ import annotations

import json

import pytest
import torch

from hicache.cli.main import main


def test_blockcopy_rows_for_each_dtype_and_method(capsys):
    assert main(["bench", "blockcopy", "--json", "--layers", "2", "--kv-heads", "2", "--head-size", "16",
                 "--block-size", "8", "--target-mib", "1", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "blockcopy"
    names = [r["name"] for r in out["results"]]
    assert names == [name for dtype in ("float32", "bfloat16")
                     for name in (f"save all layers {dtype} native", f"save all layers {dtype} torch",
                                  f"load per layer {dtype} native", f"load per layer {dtype} torch",
                                  f"save, first touch {dtype} native")]
    for r in out["results"]:
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0
        assert r["baseline_name"] == "memcpy" and 0 < r["ratio_min"] <= r["ratio"] and r["repeats"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blockcopy_cuda_rows_for_each_method(capsys):
    assert main(["bench", "blockcopy", "--device", "cuda", "--json", "--layers", "2", "--kv-heads", "2",
                 "--head-size", "64", "--block-size", "16", "--target-mib", "4", "--repeats", "2",
                 "--dtypes", "bfloat16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = [r["name"] for r in out["results"]]
    assert names == [f"cuda {kind} bfloat16 {method}" for kind in ("save all layers", "load per layer")
                     for method in ("triton", "torch")]
    for r in out["results"]:
        assert r["value"] > 0 and r["baseline_name"] == "contiguous copy" and 0 < r["ratio_min"] <= r["ratio"]
