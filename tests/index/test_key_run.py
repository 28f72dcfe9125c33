"""KeyRun, a node's page keys packed in one object: the C type (native_keys.c) and the Python
one (keys.py) behave as the list of keys they replace, and as each other."""

from __future__ import annotations

import random

import pytest

from hicache.index import native_index
from hicache.index.keys import KeyRun, PackedKeys, key_run

NATIVE = native_index.load()
TYPES = [KeyRun] + ([NATIVE.KeyRun] if NATIVE is not None else [])


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


@pytest.fixture(params=TYPES, ids=lambda t: "python" if t is KeyRun else "c")
def kind(request):
    return request.param


def test_a_run_reads_as_the_list_of_its_keys(kind):
    ks = keys(7)
    run = kind(b"".join(ks))
    assert len(run) == 7 and list(run) == ks and run == ks and run == tuple(ks) and not run != ks
    assert [run[i] for i in range(-7, 7)] == ks[-7:] + ks
    assert run[2:5] == ks[2:5] and type(run[2:5]) is kind and run[5:2] == [] and run[::2] == ks[::2]
    assert type(run[::2]) is list
    assert ks[3] in run and bytearray(ks[3]) in run and b"x" * 16 not in run and ks[3][:8] not in run
    assert run.index(ks[4]) == 4 and run.blob == b"".join(ks) and bytes(run) == b"".join(ks)
    assert run != ks[:6] and run != ks[::-1] and run != "keys" and kind(b"") == [] and not kind(b"")


def test_a_key_across_two_keys_is_not_in_the_run(kind):
    ks = keys(2, 1)
    run = kind(b"".join(ks))
    straddling = (ks[0][8:] + ks[1][:8])
    assert straddling not in run
    with pytest.raises(ValueError):
        run.index(straddling)


def test_bad_runs_and_bad_indexes_are_refused(kind):
    with pytest.raises(ValueError, match="16-byte"):
        kind(b"x" * 17)
    run = kind(b"".join(keys(3)))
    with pytest.raises(IndexError):
        run[3]
    with pytest.raises(IndexError):
        run[-4]
    with pytest.raises(TypeError):
        run["a"]
    with pytest.raises(TypeError):
        hash(run)


@pytest.mark.skipif(NATIVE is None, reason="the index's C module is not built here")
def test_the_c_and_python_runs_are_equal_to_each_other():
    blob = b"".join(keys(5, 2))
    c, py = NATIVE.KeyRun(blob), KeyRun(blob)
    assert c == py and py == c and c[1:] == py[1:] and not (c != py)
    assert c != KeyRun(blob[16:]) and KeyRun(blob[16:]) != c


def test_key_run_packs_lists_packed_keys_runs_and_blobs():
    ks = keys(4, 3)
    blob = b"".join(ks)
    for source in (ks, tuple(ks), PackedKeys(blob), blob, memoryview(blob), KeyRun(blob), key_run(ks)):
        run = key_run(source)
        assert run == ks and run.blob == blob
