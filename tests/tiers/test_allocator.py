"""Token-slot allocators: the seed example, decode, scarcity, misuse, frees,
and a scheduler-like random run checked against a per-request Python model."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.errors import HiCacheError
from hicache.tiers.device.allocator import AllocatorError, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    return sorted(set((slots // page_size).tolist()))


def snapshot(alloc: PagedTokenToKVPoolAllocator) -> tuple[list[int], int]:
    return alloc.free_pages.tolist(), alloc.available_size()


# ------------------------------------------------------------------ seed case

def test_seed_example_extend_fills_partial_page_then_new_pages():
    alloc = PagedTokenToKVPoolAllocator(32, 4)       # pages 1..8
    held = alloc.alloc(32)
    assert held.tolist() == list(range(4, 36))
    alloc.free(torch.tensor([12, 13, 20]))            # pages 3 and 5 back
    assert alloc.free_pages.tolist() == [3, 5]
    # 6 tokens held, the last in slot 5 (page 1 half full); grow to 13.
    out = alloc.alloc_extend(torch.tensor([6]), torch.tensor([13]), torch.tensor([5]))
    assert out.tolist() == [6, 7, 12, 13, 14, 15, 20]
    assert out.dtype == torch.int64
    assert alloc.num_free_pages == 0 and alloc.available_size() == 0


def test_decode_within_a_page_and_across_a_boundary():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    pages = alloc.alloc(8)                            # pages 1, 2 -> slots 4..11
    assert alloc.free_pages[:2].tolist() == [3, 4]
    # Request A holds 6 tokens ending at slot 9 (page 2): token 7 -> slot 10.
    # Request B holds 4 tokens ending at slot 7 (page 1 full): token 5 opens page 3.
    out = alloc.alloc_decode(torch.tensor([7, 5]), torch.tensor([9, 7]))
    assert out.tolist() == [10, 12]
    assert alloc.free_pages[0].item() == 4
    # B's next token continues in page 3; A fills slot 11, then opens page 4.
    assert alloc.alloc_decode([6, 8], [12, 10]).tolist() == [13, 11]
    assert alloc.alloc_decode([9], [11]).tolist() == [16]
    assert pages.numel() == 8


def test_lists_are_accepted_like_tensors():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    assert alloc.alloc_extend([0, 0], [5, 2], [-1, -1]).tolist() == [4, 5, 6, 7, 8, 12, 13]
    alloc.free([4, 5, 6, 7, 8])
    assert alloc.free_pages[:2].tolist() == [1, 2]


# ---------------------------------------------------------------- scarcity

def test_extend_out_of_space_returns_none_and_changes_nothing():
    alloc = PagedTokenToKVPoolAllocator(64, 16)      # 4 pages
    first = alloc.alloc_extend([0], [20], [-1])      # 2 pages
    before = snapshot(alloc)
    # Request 0 grows by 13 (fits its page, then 1 new page), request 1 needs 3 pages.
    assert alloc.alloc_extend([20, 0], [33, 40], [first[-1].item(), -1]) is None
    assert snapshot(alloc) == before
    # The same state still serves what fits, so nothing was marked taken.
    assert alloc.alloc_extend([20, 0], [33, 10], [first[-1].item(), -1]) is not None
    assert alloc.num_free_pages == 0


def test_decode_out_of_space_returns_none_and_changes_nothing():
    alloc = PagedTokenToKVPoolAllocator(8, 4)        # 2 pages
    out = alloc.alloc_extend([0, 0], [4, 4], [-1, -1])
    before = snapshot(alloc)
    assert alloc.alloc_decode([5, 5], [out[3].item(), out[7].item()]) is None
    assert snapshot(alloc) == before
    alloc.free(out[:4])
    assert alloc.alloc_decode([5], [out[7].item()]).tolist() == [4]


def test_alloc_pages_and_scarcity():
    alloc = PagedTokenToKVPoolAllocator(48, 16)
    assert alloc.alloc(0).numel() == 0
    got = alloc.alloc(32)
    assert got.tolist() == list(range(16, 48))
    assert alloc.alloc(32) is None
    assert alloc.available_size() == 16
    with pytest.raises(AllocatorError):
        alloc.alloc(10)                              # not whole pages
    with pytest.raises(AllocatorError):
        alloc.alloc(-16)
    assert alloc.available_size() == 16


# ------------------------------------------------------------------ misuse

@pytest.mark.parametrize("args", [
    ([0, 0], [4], [-1, -1]),                         # shape mismatch
    ([[0]], [[4]], [[-1]]),                           # 2-D
    ([5], [3], [20]),                                # seq < prefix
    ([-1], [3], [-1]),                               # negative prefix
    ([0.0], [4.0], [-1.0]),                          # floats
    ([6], [9], [6]),                                 # last_loc at the wrong offset
    ([6], [9], [41]),                                # last_loc in a free page
    ([6], [9], [1]),                                 # last_loc in the padding page
    ([6], [9], [1_000_001]),                         # last_loc out of range
])
def test_invalid_extend_raises_and_changes_nothing(args):
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    alloc.alloc(8)                                   # pages 1, 2 held
    before = snapshot(alloc)
    with pytest.raises(AllocatorError) as info:
        alloc.alloc_extend(*args)
    assert isinstance(info.value, ValueError) and isinstance(info.value, HiCacheError)
    assert snapshot(alloc) == before


def test_last_loc_is_ignored_where_unused():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    # Page-aligned prefix and zero-length extend: last_loc is never read.
    assert alloc.alloc_extend([8, 6], [9, 6], [-7, 12345]).tolist() == [4]


@pytest.mark.parametrize("args", [
    ([1, 2], [5]),                                   # shape mismatch
    ([0], [-1]),                                     # seq_len must count the new token
    ([7], [11]),                                     # wrong offset (slot 11 ends a page)
    ([7], [17]),                                     # page 4 is free
])
def test_invalid_decode_raises_and_changes_nothing(args):
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    alloc.alloc(8)
    before = snapshot(alloc)
    with pytest.raises(AllocatorError):
        alloc.alloc_decode(*args)
    assert snapshot(alloc) == before


def test_bad_construction():
    with pytest.raises(AllocatorError):
        PagedTokenToKVPoolAllocator(30, 4)
    with pytest.raises(AllocatorError):
        PagedTokenToKVPoolAllocator(32, 0)
    with pytest.raises(AllocatorError):
        PagedTokenToKVPoolAllocator(32, 4, backend="cuda")


def test_backend_choice_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert PagedTokenToKVPoolAllocator(32, 4).backend == "torch"
    assert PagedTokenToKVPoolAllocator(32, 4, backend="torch").backend == "torch"
    # Compiled Triton cannot run on CPU tensors: refused up front, not at the first call.
    with pytest.raises(AllocatorError):
        PagedTokenToKVPoolAllocator(32, 4, backend="triton")


# ------------------------------------------------------------------ freeing

def test_free_then_alloc_round_trip():
    alloc = PagedTokenToKVPoolAllocator(64, 8)
    a = alloc.alloc_extend([0, 0, 0], [10, 3, 24], [-1, -1, -1])
    assert alloc.num_free_pages == 8 - 6
    alloc.free(a)
    assert alloc.available_size() == 64
    assert sorted(alloc.free_pages.tolist()) == list(range(1, 9))
    # Freed pages go to the front, so they are handed out again first.
    b = alloc.alloc(8 * 6)
    assert pages_of(b, 8) == pages_of(a, 8)
    alloc.free(b)
    alloc.clear()
    assert alloc.free_pages.tolist() == list(range(1, 9))


def test_free_partial_page_frees_the_whole_page_once():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    out = alloc.alloc_extend([0], [6], [-1])         # slots 4..9
    alloc.free(out[4:])                              # slots 8, 9 -> page 2
    assert alloc.free_pages[0].item() == 2
    alloc.free(torch.tensor([6, 4, 6]))              # page 1, named three times
    assert alloc.free_pages.tolist() == [1, 2] + list(range(3, 17))
    with pytest.raises(AllocatorError):
        alloc.free([5])                              # now a double free


@pytest.mark.parametrize("num_named", [3, 400])  # a short list sorts, a long one uses the page mask
def test_free_folds_repeats_for_short_and_long_lists(num_named):
    alloc = PagedTokenToKVPoolAllocator(1024 * 4, 4)
    held = alloc.alloc(4 * 200)                      # pages 1..200
    rng = random.Random(num_named)
    named = [rng.choice(held.tolist()) for _ in range(num_named)]
    alloc.free(named)
    pages = sorted({slot // 4 for slot in named})
    assert alloc.free_pages[: len(pages)].tolist() == pages
    assert alloc.num_free_pages == 1024 - 200 + len(pages)
    with pytest.raises(AllocatorError):
        alloc.free([named[-1]])


@pytest.mark.parametrize("bad", [[0], [3], [-4], [68], [5, 9], [9, 7.0]])
def test_bad_free_raises_and_changes_nothing(bad):
    # padding slot 0, padding page slot 3, negative, past the end, a slot of
    # a page that is already free, and a float.
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    alloc.alloc(8)                                   # pages 1, 2 (slots 4..11)
    alloc.free([4])                                  # page 1 free again
    before = snapshot(alloc)
    with pytest.raises(AllocatorError):
        alloc.free(bad)
    assert snapshot(alloc) == before
    alloc.free([9])                                  # page 2 is still held
    assert alloc.available_size() == 64


def test_free_group_batches_frees():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    slots = alloc.alloc(24)                          # pages 1..6
    alloc.free_group_begin()
    alloc.free(slots[0:8])                           # pages 1, 2
    alloc.free(slots[20:24])                         # page 6
    assert alloc.num_free_pages == 10                # held back until the end
    with pytest.raises(AllocatorError):
        alloc.free(slots[4:5])                       # page 2 is already freed in this group
    with pytest.raises(AllocatorError):
        alloc.free_group_begin()
    alloc.free_group_end()
    assert alloc.free_pages[:3].tolist() == [1, 2, 6]
    assert alloc.num_free_pages == 13
    with pytest.raises(AllocatorError):
        alloc.free_group_end()
    # An empty group is fine.
    alloc.free_group_begin()
    alloc.free_group_end()
    assert alloc.num_free_pages == 13


def test_pending_page_is_not_a_valid_last_loc():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    out = alloc.alloc_extend([0], [6], [-1])         # slots 4..9, last 9
    alloc.free_group_begin()
    alloc.free(out)
    with pytest.raises(AllocatorError):
        alloc.alloc_extend([6], [7], [9])
    alloc.free_group_end()


# ------------------------------------------------------------ token (ps=1)

def test_token_allocator_basics():
    alloc = TokenToKVPoolAllocator(10)
    assert alloc.page_size == 1 and alloc.available_size() == 10
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert alloc.alloc_extend([3, 0], [5, 2], [3, -1]).tolist() == [4, 5, 6, 7]
    assert alloc.alloc_decode([6, 3], [5, 7]).tolist() == [8, 9]
    assert alloc.alloc(2) is None and alloc.alloc_decode([1, 1], [-1, -1]) is None
    assert alloc.available_size() == 1
    alloc.free(torch.tensor([6, 2, 6]))              # repeats fold; pages come back sorted
    assert alloc.free_pages.tolist() == [2, 6, 10]
    with pytest.raises(AllocatorError):
        alloc.free([6])
    with pytest.raises(AllocatorError):
        alloc.free([0])
    with pytest.raises(AllocatorError):
        alloc.free([11])
    alloc.clear()
    assert alloc.free_pages.tolist() == list(range(1, 11))


# ------------------------------------------------- random scheduler run

def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class RefAllocator:
    """Per-request Python model of the paged allocator."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.free = list(range(1, num_pages + 1))
        self.ps = page_size

    def extend(self, rows: list[tuple[int, int, int]]) -> list[int] | None:
        ps = self.ps
        need = sum(ceil_div(seq, ps) - ceil_div(prefix, ps) for prefix, seq, _ in rows)
        if need > len(self.free):
            return None
        out, cursor = [], 0
        for prefix, seq, last in rows:
            page = None
            for pos in range(prefix, seq):
                if pos < ceil_div(prefix, ps) * ps:  # inside the prefix's last page
                    out.append(last + 1 + pos - prefix)
                    continue
                if pos % ps == 0:
                    page, cursor = self.free[cursor], cursor + 1
                out.append(page * ps + pos % ps)
        self.free = self.free[cursor:]
        return out

    def decode(self, rows: list[tuple[int, int]]) -> list[int] | None:
        if sum((seq - 1) % self.ps == 0 for seq, _ in rows) > len(self.free):
            return None
        out = []
        for seq, last in rows:
            if (seq - 1) % self.ps == 0:
                out.append(self.free.pop(0) * self.ps)
            else:
                out.append(last + 1)
        return out

    def release(self, slots: list[int]) -> list[int]:
        return sorted({s // self.ps for s in slots})


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(12))
def test_random_scheduler_run_matches_reference(page_size, seed):
    rng = random.Random(seed * 31 + page_size)
    num_pages = rng.choice([8, 40, 200])
    alloc = PagedTokenToKVPoolAllocator(num_pages * page_size, page_size)
    ref = RefAllocator(num_pages, page_size)
    live: list[list[int]] = []                       # each request's slots, token order
    for _ in range(60):
        op = rng.random()
        if op < 0.4:                                 # prefill: new requests and chunked extends
            old = rng.sample(range(len(live)), min(len(live), rng.randint(0, 3)))
            rows = [(len(live[i]), len(live[i]) + rng.randint(0, 3 * page_size + 2), live[i][-1]) for i in old]
            new = rng.randint(0, 4)
            rows += [(0, rng.randint(0, 5 * page_size + 3), -1) for _ in range(new)]
            owners: list[int | None] = old + [None] * new
            order = list(range(len(rows)))
            rng.shuffle(order)
            rows = [rows[k] for k in order]
            owners = [owners[k] for k in order]
            want = ref.extend(rows)
            got = alloc.alloc_extend([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
            assert (got is None) == (want is None)
            if got is None:
                continue
            assert got.tolist() == want
            at = 0
            for (prefix, seq, _), owner in zip(rows, owners):
                chunk = got[at: at + seq - prefix].tolist()
                at += seq - prefix
                if owner is None:
                    if chunk:
                        live.append(chunk)
                else:
                    live[owner] += chunk
        elif op < 0.75 and live:                     # decode a batch
            batch = rng.sample(range(len(live)), rng.randint(1, len(live)))
            rows = [(len(live[i]) + 1, live[i][-1]) for i in batch]
            want = ref.decode(rows)
            got = alloc.alloc_decode([r[0] for r in rows], [r[1] for r in rows])
            assert (got is None) == (want is None)
            if got is not None:
                assert got.tolist() == want
                for i, slot in zip(batch, got.tolist()):
                    live[i].append(slot)
        elif live:                                   # finish requests, sometimes as a group
            done = sorted(rng.sample(range(len(live)), rng.randint(1, len(live))), reverse=True)
            grouped = rng.random() < 0.5
            if grouped:
                alloc.free_group_begin()
            freed = []
            for i in done:
                slots = live.pop(i)
                alloc.free(torch.tensor(slots))
                freed += ref.release(slots)
                if not grouped:
                    ref.free = ref.release(slots) + ref.free
            if grouped:
                alloc.free_group_end()
                ref.free = freed + ref.free
        # Invariants after every step.
        assert alloc.free_pages.tolist() == ref.free
        held = [p for slots in live for p in {s // page_size for s in slots}]
        assert len(held) == len(set(held)), "a page is shared by two requests"
        assert not set(held) & set(ref.free)
        assert 0 not in held
        assert alloc.available_size() == len(ref.free) * page_size
