"""The batch slot-allocation kernels: the torch twin against a per-request
Python reference, and the Triton kernels against the twin (exactly) — on CPU
through Triton's interpreter in a subprocess, on CUDA under the `gpu` marker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hicache
from hicache.kernels.alloc import alloc_decode_torch, alloc_extend_torch, num_new_pages_extend
from hicache.kernels.triton_env import triton_installed
from tests.kv_pages import run_triton_aot

REPO_ROOT = Path(hicache.__file__).resolve().parent.parent


# ---------------------------------------------------------------- reference

def ref_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size):
    """Request by request, token by token: the old partial page, then new pages."""
    out, cursor = [], 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc):
        page = None
        for pos in range(prefix, seq):
            if pos < -(-prefix // page_size) * page_size:  # still inside the prefix's last page
                out.append(last + 1 + (pos - prefix))
                continue
            if pos % page_size == 0:
                page = free_pages[cursor]
                cursor += 1
            out.append(page * page_size + pos % page_size)
    return out, cursor


def ref_decode(seq_lens, last_loc, free_pages, page_size):
    out, cursor = [], 0
    for seq, last in zip(seq_lens, last_loc):
        if (seq - 1) % page_size == 0:
            out.append(free_pages[cursor] * page_size)
            cursor += 1
        else:
            out.append(last + 1)
    return out, cursor


# ------------------------------------------------------------ random inputs

def random_extend(gen: torch.Generator, bs: int, page_size: int, max_prefix: int = 300, max_extend: int = 200):
    """A valid extend batch with awkward rows mixed in: empty prefixes,
    page-aligned prefixes, zero-length extends, extends inside one page."""
    prefix = torch.randint(0, max_prefix + 1, (bs,), generator=gen)
    extend = torch.randint(0, max_extend + 1, (bs,), generator=gen)
    kind = torch.randint(0, 6, (bs,), generator=gen)
    prefix = torch.where(kind == 0, 0, prefix)
    prefix = torch.where(kind == 1, prefix // page_size * page_size, prefix)
    extend = torch.where(kind == 2, 0, extend)
    extend = torch.where(kind == 3, extend % page_size, extend)
    seq = prefix + extend
    # The last prefix token sits at offset (prefix - 1) % page_size of some held page.
    held_page = torch.randint(1, 10_000, (bs,), generator=gen)
    last = torch.where(prefix > 0, held_page * page_size + (prefix - 1) % page_size, -1)
    num_new = int(num_new_pages_extend(prefix, seq, page_size).sum())
    free = torch.randperm(num_new + 7, generator=gen)[: num_new + 3] + 10_001
    return prefix, seq, last, free


def random_decode(gen: torch.Generator, bs: int, page_size: int):
    seq = torch.randint(1, 500, (bs,), generator=gen)
    held_page = torch.randint(1, 10_000, (bs,), generator=gen)
    last = held_page * page_size + (seq - 2) % page_size
    num_new = int(((seq - 1) % page_size == 0).sum())
    free = torch.randperm(num_new + 5, generator=gen)[: num_new + 2] + 10_001
    return seq, last, free


# --------------------------------------------------------------- torch twin

def test_seed_example():
    # page_size 4; 6 tokens held, the last in slot 5 (page 1 half full);
    # extend to 13: slots 6, 7, then page 3 whole, then one slot of page 5.
    out, used = alloc_extend_torch(torch.tensor([6]), torch.tensor([13]), torch.tensor([5]),
                                   torch.tensor([3, 5, 9]), 4)
    assert out.tolist() == [6, 7, 12, 13, 14, 15, 20]
    assert used == 2


def test_extend_edge_rows():
    # prefix 0; aligned prefix; zero extend; extend ending inside the old page;
    # extend ending exactly on a page boundary.
    prefix = torch.tensor([0, 8, 5, 5, 6])
    seq = torch.tensor([5, 10, 5, 7, 12])
    last = torch.tensor([-1, 43, 21, 29, 33])
    free = torch.tensor([7, 9, 11, 13])
    out, used = alloc_extend_torch(prefix, seq, last, free, 4)
    assert out.tolist() == [28, 29, 30, 31, 36, 44, 45, 30, 31, 34, 35, 52, 53, 54, 55]
    assert used == 4


@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 16, 64])
def test_extend_twin_matches_reference(page_size):
    gen = torch.Generator().manual_seed(1000 + page_size)
    for _ in range(40):
        bs = int(torch.randint(1, 40, (1,), generator=gen))
        prefix, seq, last, free = random_extend(gen, bs, page_size)
        out, used = alloc_extend_torch(prefix, seq, last, free, page_size)
        want, want_used = ref_extend(prefix.tolist(), seq.tolist(), last.tolist(), free.tolist(), page_size)
        assert out.dtype == torch.int64
        assert out.tolist() == want
        assert used == want_used


@pytest.mark.parametrize("page_size", [1, 3, 4, 16, 64])
def test_decode_twin_matches_reference(page_size):
    gen = torch.Generator().manual_seed(2000 + page_size)
    for _ in range(40):
        bs = int(torch.randint(1, 60, (1,), generator=gen))
        seq, last, free = random_decode(gen, bs, page_size)
        out, used = alloc_decode_torch(seq, last, free, page_size)
        want, want_used = ref_decode(seq.tolist(), last.tolist(), free.tolist(), page_size)
        assert out.tolist() == want
        assert used == want_used


def test_decode_within_and_across_pages():
    # seq 6 -> slot after last; seq 9 opens a page; seq 1 (first token) opens a page.
    out, used = alloc_decode_torch(torch.tensor([6, 9, 1]), torch.tensor([20, 31, -1]), torch.tensor([4, 2]), 4)
    assert out.tolist() == [21, 16, 8]
    assert used == 2


def test_twins_refuse_short_free_list():
    with pytest.raises(ValueError):
        alloc_extend_torch(torch.tensor([0]), torch.tensor([9]), torch.tensor([-1]), torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError):
        alloc_decode_torch(torch.tensor([1, 5]), torch.tensor([-1, -1]), torch.empty(0, dtype=torch.int64), 4)


def test_empty_batches():
    empty = torch.empty(0, dtype=torch.int64)
    out, used = alloc_extend_torch(empty, empty, empty, empty, 16)
    assert out.numel() == 0 and used == 0
    out, used = alloc_decode_torch(empty, empty, empty, 16)
    assert out.numel() == 0 and used == 0


# ------------------------------------------- Triton under the CPU interpreter

# Runs in a fresh interpreter with TRITON_INTERPRET=1 set before Triton is
# first imported, so the rest of the test session keeps compiled Triton.
_INTERPRET_RUNNER = textwrap.dedent("""
    import sys, torch
    from hicache.kernels.alloc_triton import alloc_decode_triton, alloc_extend_triton, triton_usable
    from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
    assert triton_usable(torch.device("cpu"))
    cases = torch.load(sys.argv[1])
    kernels = []
    for c in cases:
        if c["op"] == "extend":
            out = alloc_extend_triton(c["prefix"], c["seq"], c["last"], c["free"], c["page_size"],
                                      c["num_tokens"], block_bs=c["block_bs"], block_tok=c["block_tok"])
        else:
            out = alloc_decode_triton(c["seq"], c["last"], c["free"], c["page_size"], block_bs=c["block_bs"])
        kernels.append(out)

    def drive(backend):
        # The allocator end to end: a seed-style extend, a batch of new
        # requests, a chunked second extend, decodes, a free, more extends.
        alloc = PagedTokenToKVPoolAllocator(256, 4, backend=backend)
        assert alloc.backend == backend
        log = []
        held = alloc.alloc(16)                        # pages 1..4
        alloc.free(held[[4, 12]])                     # pages 2 and 4 back in front
        log.append(alloc.alloc_extend([6], [13], [5]))
        log.append(alloc.alloc_decode([14, 9], [16, -1]))
        lens = torch.tensor([5, 0, 17, 4, 9])
        first = alloc.alloc_extend(torch.zeros(5, dtype=torch.long), lens, torch.full((5,), -1))
        log.append(first)
        ends = torch.cumsum(lens, 0) - 1
        last = torch.where(lens > 0, first[ends.clamp(min=0)], -1)
        grow = torch.tensor([3, 4, 8, 0, 7])
        log.append(alloc.alloc_extend(lens, lens + grow, last))
        alloc.free(first[5:22])                       # request 2's first chunk
        log.append(alloc.alloc_extend([0, 0], [30, 3], [-1, -1]))
        log.append(alloc.alloc_extend([0], [10_000], [-1]))   # does not fit: None
        log.append(alloc.free_pages.clone())
        return log

    torch.save({"kernels": kernels, "triton": drive("triton"), "torch": drive("torch")}, sys.argv[2])
""")


def _interpreter_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    cases = []
    for page_size in (1, 3, 4, 16, 64):
        # Default blocks (one loop step) and tiny blocks (several steps in both
        # the prefix-sum loop and the token loop).
        for bs, block_bs, block_tok in ((1, 512, 1024), (8, 512, 1024), (13, 4, 16), (37, 8, 32)):
            prefix, seq, last, free = random_extend(gen, bs, page_size)
            cases.append(dict(op="extend", page_size=page_size, prefix=prefix, seq=seq, last=last, free=free,
                              num_tokens=int((seq - prefix).sum()), block_bs=block_bs, block_tok=block_tok))
            dseq, dlast, dfree = random_decode(gen, bs, page_size)
            cases.append(dict(op="decode", page_size=page_size, seq=dseq, last=dlast, free=dfree, block_bs=block_bs))
    # A re-sliced free list starting at an odd offset (not 16-byte aligned).
    prefix, seq, last, free = random_extend(gen, 9, 16)
    padded = torch.cat([torch.tensor([999_999]), free])
    cases.append(dict(op="extend", page_size=16, prefix=prefix, seq=seq, last=last, free=padded[1:],
                      num_tokens=int((seq - prefix).sum()), block_bs=512, block_tok=1024))
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not triton_installed():
        pytest.skip("triton is not installed")
    tmp = tmp_path_factory.mktemp("alloc_interp")
    cases = _interpreter_cases()
    torch.save(cases, tmp / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_RUNNER, str(tmp / "cases.pt"), str(tmp / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        pytest.fail(f"interpreter run failed:\n{proc.stderr[-4000:]}")
    return cases, torch.load(tmp / "out.pt")


def test_interpreted_kernels_match_twin(interpreted):
    cases, results = interpreted
    assert len(results["kernels"]) == len(cases)
    for case, got in zip(cases, results["kernels"]):
        if case["op"] == "extend":
            want, _ = alloc_extend_torch(case["prefix"], case["seq"], case["last"], case["free"], case["page_size"])
        else:
            want, _ = alloc_decode_torch(case["seq"], case["last"], case["free"], case["page_size"])
        assert torch.equal(got, want), case


def test_interpreted_allocator_matches_torch_backend(interpreted):
    _, results = interpreted
    tri, ref = results["triton"], results["torch"]
    assert len(tri) == len(ref)
    for got, want in zip(tri, ref):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
    # Free list [2, 4, 5, ...]: the held request (6 tokens, last in slot 5)
    # grows to 13 -> slots 6, 7, page 2, one slot of page 4.
    assert tri[0].tolist() == [6, 7, 8, 9, 10, 11, 16]
    # seq 14 continues after slot 16; seq 9 opens page 5.
    assert tri[1].tolist() == [17, 20]
    assert tri[-2] is None


# Compiles both kernels for an sm_90 target without a GPU (Triton ships
# ptxas): catches what only the compiler rejects (types of loop-carried
# values, scalar control flow) on machines where the interpreter is all that
# runs. Exit code 77: this Triton lacks the internal API used here.
_AOT_RUNNER = textwrap.dedent("""
    import sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        sys.exit(77)
    from hicache.kernels.alloc_triton import _kernels
    k = _kernels()
    target = GPUTarget("cuda", 90, 32)
    for page_size in (1, 16, 64):
        ptrs = ("prefix_lens_ptr", "seq_lens_ptr", "last_loc_ptr", "free_pages_ptr", "out_ptr")
        sig = {name: "*i64" for name in ptrs} | {"PAGE_SIZE": "constexpr", "BLOCK_BS": "constexpr",
                                                 "BLOCK_TOK": "constexpr"}
        consts = {"PAGE_SIZE": page_size, "BLOCK_BS": 512, "BLOCK_TOK": 1024}
        assert "cubin" in triton.compile(ASTSource(fn=k.extend, signature=sig, constexprs=consts), target=target).asm
        sig = {name: "*i64" for name in ptrs[1:]} | {"PAGE_SIZE": "constexpr", "BLOCK_BS": "constexpr"}
        consts = {"PAGE_SIZE": page_size, "BLOCK_BS": 512}
        assert "cubin" in triton.compile(ASTSource(fn=k.decode, signature=sig, constexprs=consts), target=target).asm
""")


def test_kernels_compile_for_cuda_without_a_gpu(tmp_path):
    run_triton_aot(_AOT_RUNNER, tmp_path)


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", [1, 8, 13, 255, 1024, 3001])
def test_triton_extend_matches_twin_on_cuda(page_size, bs):
    from hicache.kernels.alloc_triton import alloc_extend_triton

    gen = torch.Generator().manual_seed(bs * 100 + page_size)
    prefix, seq, last, free = (t.cuda() for t in random_extend(gen, bs, page_size, max_prefix=2000, max_extend=700))
    want, _ = alloc_extend_torch(prefix, seq, last, free, page_size)
    got = alloc_extend_triton(prefix, seq, last, free, page_size, want.numel())
    assert torch.equal(got, want)
    # The same kernel on a free list re-sliced to an unaligned start.
    shifted = torch.cat([free[:1], free])[1:]
    assert torch.equal(alloc_extend_triton(prefix, seq, last, shifted, page_size, want.numel()), want)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", [1, 8, 13, 255, 1024, 3001])
def test_triton_decode_matches_twin_on_cuda(page_size, bs):
    from hicache.kernels.alloc_triton import alloc_decode_triton

    gen = torch.Generator().manual_seed(bs * 100 + page_size + 1)
    seq, last, free = (t.cuda() for t in random_decode(gen, bs, page_size))
    want, _ = alloc_decode_torch(seq, last, free, page_size)
    assert torch.equal(alloc_decode_triton(seq, last, free, page_size), want)
