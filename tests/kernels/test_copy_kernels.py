"""Page-copy kernels: the memcpy path and the Triton kernels against the torch
twins, byte for byte. Triton runs in its interpreter in a subprocess on CPU,
and on CUDA under the `gpu` marker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.kernels import copy as kcopy
from hicache.kernels import copy_triton, triton_env
from hicache.layout import KVLayout
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostArena, HostKVCache
from tests.kv_pages import random_pool, run_triton_aot

REPO = Path(__file__).resolve().parents[2]


def test_wide_dtype_is_the_widest_that_divides():
    assert kcopy.wide_dtype(4096, 1024) == (torch.int64, 8)
    assert kcopy.wide_dtype(4096, 12) == (torch.int32, 4)
    assert kcopy.wide_dtype(6) == (torch.int16, 2)
    assert kcopy.wide_dtype(4096, 3) == (torch.uint8, 1)


def test_geometry_offsets_follow_the_page_first_layout():
    layout = KVLayout("mha", 4, 16, "float16", num_kv_heads=8, head_dim=128, v_head_dim=64)
    g = kcopy.PageGeometry.from_layout(layout)
    assert (g.k_bytes, g.v_bytes, g.layer_bytes, g.page_bytes) == (32768, 16384, 49152, 4 * 49152)
    assert g.width == 8 and g.dtype == torch.int64
    assert g.k_offset(2) * 8 == 2 * 49152 and g.v_offset(2) * 8 == 2 * 49152 + 32768


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    src = np.array([0, 10, 20, 100, 110, 500], dtype=np.int64)
    dst = np.array([1000, 1010, 1020, 2000, 3000, 4000], dtype=np.int64)
    nb = np.full(6, 10, dtype=np.int64)
    s, d, n = kcopy.coalesce(src, dst, nb)
    assert s.tolist() == [0, 100, 110, 500]
    assert d.tolist() == [1000, 2000, 3000, 4000]
    assert n.tolist() == [30, 10, 10, 10]


@pytest.mark.parametrize("threads", [1, 3])
def test_chunk_copier_matches_numpy(threads):
    rng = np.random.default_rng(0)
    src_buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst_buf = np.zeros(1 << 20, dtype=np.uint8)
    chunk = 1000
    n = 300
    blocks = (1 << 20) // chunk
    s_off = rng.choice(blocks, n, replace=False) * chunk
    d_off = (10 + rng.choice(blocks - 10, n, replace=False)) * chunk  # distinct destinations
    d_off[10:20] = np.arange(10) * chunk  # a run on the device side...
    start = min(s_off[10], (blocks - 10) * chunk)
    s_off[10:20] = start + np.arange(10) * chunk  # ...and the host side: one merged copy
    copier = kcopy.ChunkCopier(threads, min_split_bytes=1, min_chunk_bytes=1)
    copier.copy(src_buf.ctypes.data + s_off, dst_buf.ctypes.data + d_off, np.full(n, chunk, dtype=np.int64))
    want = np.zeros_like(dst_buf)
    for s, d in zip(s_off, d_off):
        want[d:d + chunk] = src_buf[s:s + chunk]
    assert np.array_equal(dst_buf, want)
    copier.close()


def _compare_backends(layout: KVLayout, n: int, backends: tuple[str, str], device: str = "cpu") -> None:
    """Backup n random pages and load them back per layer with two backends; the
    arena bytes and the device bytes must be identical."""
    rng = np.random.default_rng(n)
    slots, pages = n + 3, n + 5
    host = rng.choice(slots, n, replace=False)
    dev = rng.choice(np.arange(1, pages + 1), n, replace=False)
    back = rng.choice(np.arange(1, pages + 1), n, replace=False)
    src = random_pool(layout, pages, seed=n, device=device)
    results = []
    for backend in backends:
        arena = HostArena.create(slots * layout.page_bytes, mlock=False)
        cache = HostKVCache(layout, arena, device=device, backend=backend)
        cache.backup_from_device_all_layer(src, host, dev)
        dst = DevicePool(layout, pages * layout.page_size, device=device)
        for layer in range(layout.num_layers):
            cache.load_to_device_per_layer(dst, host, back, layer)
        if device != "cpu":
            torch.cuda.synchronize()
        results.append((torch.from_numpy(arena.array.copy()),
                        [b.view(torch.uint8).cpu() for b in dst.k_buffers + dst.v_buffers]))
        cache.close()
    (arena_a, dev_a), (arena_b, dev_b) = results
    assert torch.equal(arena_a, arena_b)
    assert arena_a.any()
    assert all(torch.equal(a, b) for a, b in zip(dev_a, dev_b))


LAYOUTS = {
    "mha-fp16": KVLayout("mha", 3, 4, "float16", num_kv_heads=2, head_dim=8),
    "mha-bf16-vdim": KVLayout("mha", 2, 8, "bfloat16", num_kv_heads=3, head_dim=16, v_head_dim=8),
    "mha-fp8-odd": KVLayout("mha", 2, 3, "float8_e4m3fn", num_kv_heads=1, head_dim=5),
    "mla-fp16": KVLayout("mla", 3, 4, "float16", kv_lora_rank=16, qk_rope_head_dim=8),
    "mla-fp8": KVLayout("mla", 2, 16, "float8_e4m3fn", kv_lora_rank=64, qk_rope_head_dim=16),
}


@pytest.mark.parametrize("n", [1, 8, 13])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_memcpy_path_equals_torch_twin(name, n):
    _compare_backends(LAYOUTS[name], n, ("memcpy", "torch"))


# Runs in a fresh interpreter with TRITON_INTERPRET=1 set before Triton is imported.
_INTERPRET_RUNNER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from tests.kernels.test_copy_kernels import LAYOUTS, _compare_backends
    from hicache.kernels import copy_triton
    import torch
    assert copy_triton.triton_usable(torch.device("cpu"))
    for name, layout in sorted(LAYOUTS.items()):
        for n in (1, 8, 13):
            _compare_backends(layout, n, ("triton", "torch"))
    print("INTERPRETED", len(LAYOUTS) * 3)
""")


def test_triton_kernels_equal_twin_in_interpreter():
    if not triton_env.triton_installed():
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_RUNNER, str(REPO)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"INTERPRETED {len(LAYOUTS) * 3}" in proc.stdout


def test_triton_backend_refused_where_it_cannot_run():
    if triton_env.interpreter_enabled():
        pytest.skip("interpreter mode runs kernels on CPU")
    assert not copy_triton.triton_usable(torch.device("cpu"))


# Compiles both copy kernels for sm_90 without a GPU (Triton ships ptxas), for
# every element width and with/without V, and checks that with the 16-divisible
# sizes and pointers Triton sees at run time the page data moves in 16-byte
# vector loads and stores (the index loads stay scalar). Exit 77: this Triton
# lacks the internal API used here.
_AOT_RUNNER = textwrap.dedent("""
    import re, sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        sys.exit(77)
    from hicache.kernels.copy_triton import _BLOCK, _kernels
    k = _kernels()
    target = GPUTarget("cuda", 90, 32)
    div = [["tt.divisibility", 16]]
    for elem in ("i64", "i32", "i16", "i8"):
        for has_v in (True, False):
            consts = {"HAS_V": has_v, "BLOCK": _BLOCK}
            sig = {"host_ptr": f"*{elem}", "dev_k_ptr": f"*{elem}", "dev_v_ptr": f"*{elem}",
                   "host_idx_ptr": "*i64", "dev_idx_ptr": "*i64", "layer": "i64", "page_elems": "i64",
                   "layer_elems": "i64", "k_elems": "i64", "v_elems": "i64", "HAS_V": "constexpr",
                   "BLOCK": "constexpr"}
            attrs = {(i,): div for i in (0, 1, 2, 6, 7, 8, 9)}
            load = triton.compile(ASTSource(fn=k.load_layer, signature=sig, constexprs=consts, attrs=attrs),
                                  target=target)
            sig = {"host_ptr": f"*{elem}", "k_ptrs": "*i64", "v_ptrs": "*i64", "host_idx_ptr": "*i64",
                   "dev_idx_ptr": "*i64", "page_elems": "i64", "layer_elems": "i64", "k_elems": "i64",
                   "v_elems": "i64", "HAS_V": "constexpr", "BLOCK": "constexpr"}
            attrs = {(i,): div for i in (0, 5, 6, 7, 8)}
            backup = triton.compile(ASTSource(fn=k.backup, signature=sig, constexprs=consts, attrs=attrs),
                                    target=target)
            for name, c in (("load", load), ("backup", backup)):
                assert "cubin" in c.asm, name
                if elem == "i64":
                    ptx = c.asm["ptx"]
                    assert re.search(r"ld\\.global(\\.\\w+)*\\.v2\\.b64", ptx), (name, has_v)
                    assert re.search(r"st\\.global(\\.\\w+)*\\.v2\\.b64", ptx), (name, has_v)
""")


def test_copy_kernels_compile_for_cuda_without_a_gpu(tmp_path):
    run_triton_aot(_AOT_RUNNER, tmp_path)


# The block-runs kernel (vLLM's block tensors), both directions: with 16-byte aligned
# geometry (ALIGN_BYTES 16, what BlockCopier passes when every address, stride and
# offset allows) the runs move in 16-byte vector loads and stores.
_AOT_BLOCK_RUNS = textwrap.dedent("""
    import re, sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        sys.exit(77)
    from hicache.kernels.copy_triton import _kernels
    k = _kernels()
    div = [["tt.divisibility", 16]]
    for to_host in (False, True):
        consts = {"RUN_ELEMS": 64, "RUN_BLOCK": 64, "ROWS": 16, "ALIGN_ELEMS": 2, "ALIGN_BYTES": 16,
                  "TO_HOST": to_host}
        sig = {"host_ptr": "*i64", "base_ptrs": "*i64", "run_offs_ptr": "*i64", "block_idx_ptr": "*i64",
               "page_idx_ptr": "*i64", "layer0": "i64", "block_stride": "i64", "page_elems": "i64",
               "layer_elems": "i64", "num_runs": "i64", **{c: "constexpr" for c in consts}}
        attrs = {(i,): div for i in (0, 1, 2, 6, 7, 8, 9)}
        c = triton.compile(ASTSource(fn=k.block_runs, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32))
        ptx = c.asm["ptx"]
        assert "cubin" in c.asm
        assert re.search(r"ld\\.global(\\.\\w+)*\\.v2\\.b64", ptx), to_host
        assert re.search(r"st\\.global(\\.\\w+)*\\.v2\\.b64", ptx), to_host
""")


def test_block_runs_kernel_compiles_for_cuda_without_a_gpu(tmp_path):
    run_triton_aot(_AOT_BLOCK_RUNS, tmp_path)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_LAYOUTS = {
    "mha-fp16": KVLayout("mha", 4, 16, "float16", num_kv_heads=8, head_dim=128),
    "mha-bf16": KVLayout("mha", 4, 16, "bfloat16", num_kv_heads=8, head_dim=128),
    "mha-fp8": KVLayout("mha", 4, 64, "float8_e4m3fn", num_kv_heads=4, head_dim=128),
    "mha-fp8-odd": KVLayout("mha", 2, 3, "float8_e4m3fn", num_kv_heads=1, head_dim=5),
    "mla-bf16": KVLayout("mla", 4, 16, "bfloat16", kv_lora_rank=512, qk_rope_head_dim=64),
    "mla-fp8": KVLayout("mla", 4, 64, "float8_e4m3fn", kv_lora_rank=512, qk_rope_head_dim=64),
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n", [1, 8, 13, 4096])
@pytest.mark.parametrize("name", sorted(GPU_LAYOUTS))
def test_triton_kernels_equal_twin_on_cuda(name, n):
    if not copy_triton.triton_usable(torch.device("cuda")):
        pytest.skip("triton is not usable here")
    layout = GPU_LAYOUTS[name]
    if n * layout.page_bytes > 2 << 30:
        n = max(13, (2 << 30) // layout.page_bytes)
    _compare_backends(layout, n, ("triton", "torch"), device="cuda")


def test_transfer_bench_rows_are_well_formed():
    from hicache.bench.tiers import transfer_bench

    rows = transfer_bench.run(page_sizes=(4,), num_layers=2, num_kv_heads=2, head_dim=64,
                              target_bytes=1 << 20, repeats=1, threads=(1,))
    assert [r["name"] for r in rows] == ["load_per_layer_ps4_t1", "backup_all_layer_ps4_t1", "worst_ratio"]
    for r in rows[:2]:
        assert {"name", "value", "unit", "baseline", "ratio"} <= set(r)
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0 and r["ratio"] > 0


def test_device_transfer_bench_runs_every_method_on_cpu():
    # The GPU bench's code path on CPU pools: every method moves the bytes (the
    # bench checks each one) and reports against the contiguous copy.
    from hicache.bench.tiers import device_transfer_bench as dtb

    rows = dtb.run(page_sizes=(4,), device="cpu", num_layers=2, num_kv_heads=2, head_dim=64,
                   target_bytes=1 << 20, repeats=1, run_pages=8)
    names = [r["name"] for r in rows]
    for op in ("load_per_layer", "backup_all_layer"):
        for pattern in dtb.PATTERNS:
            for method in ("memcpy", "torch", "dma", "per_page_memcpy"):
                assert f"{op}_ps4_{pattern}_{method}" in names
    for r in rows:
        assert r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0 and r["ratio"] > 0
        assert r["baseline_name"] == "contiguous"
        assert ("vs_per_page" in r) == (not r["name"].endswith("per_page_memcpy"))


@pytest.mark.parametrize("pattern", ["scattered", "runs"])
def test_bench_page_pairs(pattern):
    from hicache.bench.tiers import device_transfer_bench as dtb
    from hicache.kernels import dma

    rng = np.random.default_rng(1)
    h, d = dtb.page_pairs(pattern, 40, 96, 96, 8, rng)
    assert len(h) == len(d) == 40 and len(set(h)) == 40 and len(set(d)) == 40
    assert h.min() >= 0 and h.max() < 96 and d.min() >= 1 and d.max() <= 96
    runs = dma.find_runs(h, d)
    if pattern == "scattered":
        assert runs.length.max() == 1
    else:
        assert runs.length.min() >= 8


def test_bench_catches_a_method_that_copies_wrong_bytes(monkeypatch):
    from hicache.bench.tiers import device_transfer_bench as dtb
    from hicache.kernels import dma

    real = dma.load_layer_copies

    def off_by_one_layer(host_base, k_ptr, v_ptr, runs, layer, geom):
        return real(host_base, k_ptr, v_ptr, runs, (layer + 1) % geom.num_layers, geom)

    monkeypatch.setattr(dma, "load_layer_copies", off_by_one_layer)
    with pytest.raises(AssertionError, match="dma load"):
        dtb.run(page_sizes=(4,), device="cpu", patterns=("runs",), num_layers=2, num_kv_heads=2, head_dim=64,
                target_bytes=1 << 19, repeats=1, run_pages=8)


def test_pointer_table_refuses_unaligned_buffers():
    ok = torch.zeros(64, dtype=torch.uint8)
    assert copy_triton.pointer_table([ok], torch.device("cpu")).tolist() == [ok.data_ptr()]
    with pytest.raises(ValueError, match="16-byte aligned"):
        copy_triton.pointer_table([ok, ok[1:]], torch.device("cpu"))
