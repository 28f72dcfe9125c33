"""DiskTier.put_many_async (hicache/tiers/disk/batch.py) on real LMDB environments: a
batch is read from rows of one buffer, chained parent to child, answered once with a
result per page; bad input raises and queues nothing; a nearly full queue takes the
first pages only. The C and Python writers are compared in test_disk_native.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hicache.tiers.disk.tier import DiskTier, DiskTierConfig

SALT = bytes(range(16))
KiB = 1 << 10


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"b" * 12


class Answers:
    """on_done calls of batches (on the writer thread)."""

    def __init__(self) -> None:
        self.calls: list[list[bool]] = []
        self.lock = threading.Lock()

    def __call__(self, oks: list[bool]) -> None:
        with self.lock:
            self.calls.append(oks)


class Gate:
    """Parks the writer in a put's on_done until opened: what is queued meanwhile waits."""

    def __init__(self, tier: DiskTier) -> None:
        self.open, self.entered = threading.Event(), threading.Event()
        tier.put_async(SALT, key(99_999), None, np.arange(4, dtype=np.int32), np.ones(4 * KiB, np.uint8), self.hold)
        assert self.entered.wait(60)

    def hold(self, _key: bytes, _ok: bool) -> None:
        self.entered.set()
        self.open.wait(60)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier.open(tmp_path / "disk", 64 << 20, config=DiskTierConfig(max_queue_pages=16))
    yield t
    t.close()


def arena(slots: int, size: int) -> np.ndarray:
    return np.random.default_rng(slots + size).integers(0, 256, (slots, size), dtype=np.uint8)


def test_a_batch_is_written_from_its_rows_as_a_chain_and_answered_once(tier):
    store = arena(32, 16 * KiB)
    slots = np.array([7, 3, 3, 30, 0, 12])  # the slots a node's pages sit in (one twice)
    keys = [key(i) for i in range(len(slots))]
    tokens = np.arange(len(keys) * 8, dtype=np.int64).reshape(len(keys), 8)  # converted to int32
    answers = Answers()
    assert tier.put_many_async(SALT, keys, key(1000), tokens, store, answers, rows=slots,
                               parent_required=False) == len(keys)
    assert tier.flush(timeout_s=60)
    assert answers.calls == [[True] * len(keys)]
    records = {r.key: r for r in tier.iter_meta()}
    for i, (k, slot) in enumerate(zip(keys, slots)):
        assert records[k].parent_key == (key(1000) if i == 0 else keys[i - 1])
        assert records[k].tokens.tolist() == tokens[i].tolist()
        out = np.empty(16 * KiB, np.uint8)
        assert tier.get_into(SALT, k, out) and np.array_equal(out, store[slot])
    st = tier.stats()
    assert st["pages_written"] == len(keys) and st["puts"] == len(keys)


def test_parents_first_holds_inside_a_batch(tier):
    """The first page's parent is not on disk: it is refused, and so is every page under it."""
    answers = Answers()
    assert tier.put_many_async(SALT, [key(1), key(2), key(3)], key(777), np.zeros(3 * 4, np.int32),
                               arena(3, 4 * KiB), answers) == 3
    unchained = [key(11), key(12)]  # chained=False: each page hangs under the given parent
    assert tier.put_many_async(SALT, unchained, None, np.zeros(8, np.int32), arena(2, 4 * KiB), answers,
                               chained=False) == 2
    assert tier.flush(timeout_s=60)
    assert answers.calls == [[False, False, False], [True, True]]
    assert {r.key: r.parent_key for r in tier.iter_meta()} == {key(11): None, key(12): None}
    assert tier.stats()["rejected_orphan"] == 3


@pytest.mark.parametrize("change", [
    dict(keys=[]), dict(keys=[key(1), b"short"]), dict(keys=[key(1), bytearray(key(2))]),
    dict(salt=b"x"), dict(parent_key=b"y" * 3),
    dict(pages=np.zeros(8 * KiB, np.uint8)),  # one dimension: which rows are pages?
    dict(pages=np.zeros((4, 8 * KiB), np.uint8)[:, ::2]),  # not contiguous
    dict(pages="not a buffer"),
    dict(rows=np.array([0, 5])), dict(rows=np.array([-1, 0])), dict(rows=np.array([0])),
    dict(rows=np.array([0.0, 1.0])),
    dict(tokens=np.zeros(7, np.int32)), dict(tokens=np.zeros((3, 4), np.int32)), dict(tokens=np.zeros(8)),
], ids=lambda c: next(iter(c)))
def test_bad_batches_raise_and_queue_nothing(tier, change):
    args = dict(salt=SALT, keys=[key(1), key(2)], parent_key=None, tokens=np.zeros(8, np.int32),
                pages=arena(4, 8 * KiB), rows=None)
    args.update(change)
    with pytest.raises(ValueError):
        tier.put_many_async(args["salt"], args["keys"], args["parent_key"], args["tokens"], args["pages"],
                            rows=args["rows"])
    assert tier.flush(timeout_s=60)
    st = tier.stats()
    assert st["puts"] == 0 and st["pages_written"] == 0 and st["skipped_queue_full"] == 0


def test_a_nearly_full_queue_takes_the_first_pages(tier):
    gate = Gate(tier)
    answers = Answers()
    store = arena(24, 4 * KiB)
    keys = [key(i) for i in range(24)]
    assert tier.put_many_async(SALT, keys[:10], None, np.zeros(40, np.int32), store[:10], answers) == 10
    assert tier.put_many_async(SALT, keys[10:], keys[9], np.zeros(56, np.int32), store[10:], answers) == 6
    assert tier.put_many_async(SALT, keys[16:], keys[15], np.zeros(32, np.int32), store[16:], answers) == 0
    st = tier.stats()
    assert st["skipped_queue_full"] == 8 + 8 and st["queue_depth"] == 16 and st["puts"] == 1 + 16
    gate.open.set()
    assert tier.flush(timeout_s=60)
    assert answers.calls == [[True] * 10, [True] * 6]  # the refused batch is never answered
    assert {r.key for r in tier.iter_meta()} == set(keys[:16]) | {key(99_999)}


def test_a_failing_answer_does_not_kill_the_writer(tier):
    def boom(oks: list[bool]) -> None:
        raise RuntimeError("the caller's bug")

    assert tier.put_many_async(SALT, [key(1)], None, np.zeros(4, np.int32), arena(1, 4 * KiB), boom) == 1
    answers = Answers()
    assert tier.put_many_async(SALT, [key(2)], key(1), np.zeros(4, np.int32), arena(1, 4 * KiB), answers) == 1
    assert tier.flush(timeout_s=60)
    assert answers.calls == [[True]] and tier.stats()["num_pages"] == 2


def test_close_answers_what_was_queued(tmp_path):
    tier = DiskTier.open(tmp_path / "disk", 64 << 20)
    answers = Answers()
    keys = [key(i) for i in range(300)]  # more than one transaction takes
    assert tier.put_many_async(SALT, keys, None, np.zeros(300, np.int32), arena(300, 4 * KiB), answers) == 300
    tier.close()
    assert answers.calls == [[True] * 300]
    with DiskTier.open(tmp_path / "disk", 64 << 20) as again:
        assert again.num_pages == 300


def test_a_caller_that_offers_the_rest_again_is_not_counted_as_refused(tier):
    """count_refused=False (the daemon's write-through backlog): what the full queue did not
    take is offered again once it drains, and only then written; nothing counts as skipped."""
    gate = Gate(tier)
    answers = Answers()
    store = arena(24, 4 * KiB)
    keys = [key(i) for i in range(24)]
    assert tier.put_many_async(SALT, keys, None, np.zeros(96, np.int32), store, answers,
                               count_refused=False) == 16
    assert tier.stats()["skipped_queue_full"] == 0
    gate.open.set()
    assert tier.flush(timeout_s=60)
    assert tier.put_many_async(SALT, keys[16:], keys[15], np.zeros(32, np.int32), store[16:], answers,
                               count_refused=False) == 8
    assert tier.flush(timeout_s=60)
    assert answers.calls == [[True] * 16, [True] * 8]
    assert tier.stats()["skipped_queue_full"] == 0
    assert {r.key for r in tier.iter_meta()} == set(keys) | {key(99_999)}
