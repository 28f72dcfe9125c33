"""StateLayout: checkpoint bytes, identity, and the namespace salt it joins."""

from __future__ import annotations

import hashlib

import pytest

from hicache.errors import LayoutError
from hicache.index.keys import Namespace
from hicache.layout import KVLayout
from hicache.state_layout import StateLayout

KV = KVLayout("mha", num_layers=2, page_size=16, dtype="float16", num_kv_heads=2, head_dim=8)
ST = StateLayout(num_layers=3, conv_shapes=((6, 3), (2, 3)), temporal_shape=(2, 4, 5), temporal_dtype="bfloat16")


def test_checkpoint_blob_is_component_major_then_layer():
    comps = ST.components()
    assert [c.name for c in comps] == ["conv0", "conv1", "temporal"]
    assert [c.layer_bytes for c in comps] == [6 * 3 * 4, 2 * 3 * 4, 2 * 4 * 5 * 2]
    assert [c.offset for c in comps] == [0, 3 * 72, 3 * 72 + 3 * 24]
    assert ST.checkpoint_bytes == 3 * (72 + 24 + 80) == ST.num_layers * ST.layer_bytes
    assert (ST.aligned(230), ST.aligned(280), ST.aligned(63)) == (192, 256, 0)


def test_dict_round_trip_and_fingerprint():
    again = StateLayout.from_dict(ST.to_dict())
    assert again == ST and again.fingerprint() == ST.fingerprint()
    assert StateLayout.from_dict({**ST.to_dict(), "chunk_size": 128}).fingerprint() != ST.fingerprint()


@pytest.mark.parametrize("bad", [
    {"conv_shapes": [[0, 3]]}, {"conv_shapes": [[]]}, {"temporal_shape": "x"}, {"num_layers": 0},
    {"chunk_size": -64}, {"conv_dtype": "int8"}, {"extra": 1}, {"num_layers": True},
])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(LayoutError):
        StateLayout.from_dict({**ST.to_dict(), **bad})


def test_the_salt_covers_the_state_and_is_unchanged_without_one():
    plain = Namespace("m", KV)
    # the salt every pure-attention namespace had before state layouts existed
    h = hashlib.blake2b(digest_size=16, person=b"hicache-ns")
    for part in ("m", KV.fingerprint().hex(), "0", "1", ""):
        h.update(len(part.encode()).to_bytes(4, "little"))
        h.update(part.encode())
    assert plain.salt() == h.digest()
    hybrid = Namespace("m", KV, state=ST)
    other_chunk = Namespace("m", KV, state=StateLayout.from_dict({**ST.to_dict(), "chunk_size": 128}))
    assert len({plain.salt(), hybrid.salt(), other_chunk.salt()}) == 3
