"""Disk admission: the frequency sketch and the decision, as scenarios."""

from __future__ import annotations

import random

import pytest

from hicache.index import native_index
from hicache.index.admission import MAX_COUNT, AdmissionConfig, DiskAdmission, FrequencySketch, admission_key
from hicache.index.keys import PackedKeys


def test_the_sketch_never_undercounts_and_saturates():
    s = FrequencySketch(1024)
    for k in range(200):
        for _ in range(k % 5):
            s.add(k)
    assert all(s.estimate(k) >= k % 5 for k in range(200))
    assert sum(s.estimate(k) == k % 5 for k in range(200)) >= 190  # few collisions at this load
    for _ in range(40):
        s.add(7)
    assert s.estimate(7) == MAX_COUNT


def test_the_sketch_halves_every_ten_widths_of_additions():
    s = FrequencySketch(16)  # 16 counters a row: ages after 160 additions
    for _ in range(8):
        s.add(1)
    assert s.estimate(1) == 8
    for k in range(1000, 1000 + 152):  # the 160th addition ages every counter
        s.add(k)
    assert s.estimate(1) == 4


def test_bad_sketch_and_config_are_refused():
    with pytest.raises(ValueError):
        FrequencySketch(0)
    with pytest.raises(ValueError, match="disk admission"):
        AdmissionConfig(mode="sometimes")
    with pytest.raises(ValueError, match="min_count"):
        AdmissionConfig(min_count=0)


def test_a_full_disk_takes_reused_pages_and_turns_one_shot_ones_away():
    adm = DiskAdmission(AdmissionConfig(), capacity_pages=1000)
    adm.request([1, 2, 3], matched=0)  # a one-shot prompt
    adm.request([10, 11], matched=0)
    adm.request([10, 11], matched=2)  # the same prompt again: reused
    assert not adm.admit(1, 1, has_room=False)
    assert adm.admit(10, 2, has_room=False)
    assert adm.admit(1, 1, has_room=True)  # while nothing would be evicted, everything goes
    assert (adm.admitted_pages, adm.rejected_pages) == (3, 1)


def test_the_new_pages_of_a_next_turn_are_admitted_at_once():
    adm = DiskAdmission(AdmissionConfig(), capacity_pages=1000)
    adm.request([1, 2, 3], matched=0)  # turn 1 ends at page 3
    adm.request([1, 2, 3, 4, 5], matched=3)  # turn 2 extends all of turn 1
    adm.request([1, 2, 6], matched=2)  # a branch off the middle: not a next turn
    assert adm.admit(4, 2, has_room=False)
    assert not adm.admit(6, 1, has_room=False)
    off = DiskAdmission(AdmissionConfig(next_turn=False), capacity_pages=1000)
    off.request([1, 2, 3], matched=0)
    off.request([1, 2, 3, 4, 5], matched=3)
    assert not off.admit(4, 2, has_room=False)


def test_mode_all_admits_every_page():
    adm = DiskAdmission(AdmissionConfig(mode="all"), capacity_pages=1000)
    adm.request([1], matched=0)
    assert adm.admit(1, 1, has_room=False) and adm.stats()["rejected_pages"] == 0


def test_page_keys_map_to_ints_by_their_first_eight_bytes():
    assert admission_key(bytes(range(16))) == int.from_bytes(bytes(range(8)), "little")


def _page_keys(rng, n):
    return [rng.randbytes(16) for _ in range(n)]


@pytest.mark.skipif(native_index.load() is None, reason="the index's C module is not built here")
def test_the_c_sketch_counts_and_ages_as_the_python_one():
    rng = random.Random(7)
    py, c = FrequencySketch(16), FrequencySketch(16)  # small: it ages every 160 additions
    py.use_native(None)
    pool = _page_keys(rng, 300)
    for _ in range(60):
        batch = rng.choices(pool, k=rng.randrange(0, 40))
        blob = b"".join(batch)
        for k in batch:
            py.add(admission_key(k))
        c.add_pages(blob)
        assert c._table == py._table and c._added == py._added
    assert [c.estimate_page(k) for k in pool] == [py.estimate(admission_key(k)) for k in pool]
    assert any(c.estimate_page(k) for k in pool)


def test_requests_of_page_keys_count_as_requests_of_their_ints():
    rng = random.Random(3)
    by_int, by_key = DiskAdmission(AdmissionConfig(tail=True), 1000), DiskAdmission(AdmissionConfig(tail=True), 1000)
    turn = _page_keys(rng, 5)
    for keys, matched in ((turn[:3], 0), (turn, 3), (turn[:2] + _page_keys(rng, 2), 2)):
        by_int.request([admission_key(k) for k in keys], matched)
        by_key.request_pages(PackedKeys(b"".join(keys)), matched)
        by_key.request_pages(list(keys), matched)
        by_int.request([admission_key(k) for k in keys], matched)
    for sk in ("sketch", "_tails", "_hinted"):
        assert getattr(by_key, sk)._table == getattr(by_int, sk)._table
    by_key.request_pages([], 0)  # nothing to count


@pytest.mark.parametrize("native", [True, False])
def test_a_blob_of_partial_keys_is_refused(native):
    s = FrequencySketch(16)
    if not native:
        s.use_native(None)
    with pytest.raises(ValueError, match="16-byte"):
        s.add_pages(b"x" * 15)
    assert not any(s._table)
