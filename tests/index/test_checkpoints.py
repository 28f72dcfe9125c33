"""State checkpoints of hybrid models in the radix index: the rules of seeds/000 and 003, as scripts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hicache.index.checkpoints import CheckpointIndex, checkpoint_disk_key
from hicache.index.keys import page_keys
from hicache.index.node import IndexInputError, IndexStateError, Tier
from hicache.index.radix import RadixIndex
from radix_util import PS, SALT, Clock, check_invariants

HOST, DISK = Tier.HOST, Tier.DISK


class Cache:
    """A radix index with checkpoints, driven like an engine cycle of one engine:
    probe (what is usable) -> match -> insert the KV -> store the offered checkpoints."""

    def __init__(self, chunk_size: int = 64) -> None:
        self.ps = page_size = PS
        self.index = RadixIndex(page_size, SALT, clock=Clock())
        self.ckpts = CheckpointIndex(self.index, chunk_size)
        self.slots = itertools.count(1)

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        return page_keys(SALT, tokens, self.ps)

    def serve(self, tokens: np.ndarray, every: int | None = None) -> int:
        """One request: returns its usable prefix, then caches it. The engine offers its
        state at the fork the daemon told it about and at its sequence's last chunk
        boundary -- or, with `every`, at every multiple of `every` (chunked prefill)."""
        keys = self.keys(tokens)
        probe = self.ckpts.probe(keys, engine=0)
        self.index.match(keys, engine=0)
        n = len(keys)
        self.index.insert(keys, tokens[:n * self.ps], engine=0,
                          device_pages=np.arange(1, n + 1, dtype=np.int64))
        seq = n * self.ps
        if every is None:
            offered = {self.ckpts.aligned(seq)}
            if probe.fork_tokens is not None:
                offered.add(self.ckpts.aligned(probe.fork_tokens))
        else:
            offered = set(range(every, seq + 1, every))
        for pos in self.ckpts.positions_to_store(offered, seq, probe.fork_tokens):
            node = self.ckpts.node_for(keys, pos)
            _, spare = self.ckpts.put(node, host_slot=next(self.slots))
            assert spare is None or node.state.host_slot is not None
        check_invariants(self.index)
        return probe.usable_tokens

    def usable(self, tokens: np.ndarray) -> int:
        return self.ckpts.probe(self.keys(tokens), engine=0).usable_tokens

    def positions(self) -> list[int]:
        return sorted(c.position for c in self.ckpts.checkpoints(HOST))


def blocks(*ids: int, size: int = 256) -> np.ndarray:
    return np.repeat(np.asarray(ids, dtype=np.int32), size)


def test_the_issue_sequence_of_usable_prefixes():
    cache = Cache()
    script = [((1, 2), 0), ((1, 3), 0), ((1, 4), 256), ((1, 2, 5), 512), ((1, 4, 5), 512),
              ((1, 3, 5), 256), ((1, 3), 256), ((1, 3), 512)]
    got = [cache.serve(blocks(*ids)) for ids, _ in script]
    assert got == [want for _, want in script]
    # 1: fork checkpoint; 1+2, 1+4, 1+3 ends; the three "5" leaves
    assert cache.positions() == [256, 512, 512, 512, 768, 768, 768]


def test_a_fork_stores_only_the_checkpoint_at_the_fork():
    cache = Cache()
    cache.serve(blocks(1, 2))
    cache.serve(blocks(1, 3))  # forks mid-node at 256: offers 256 and 512, keeps 256
    assert cache.positions() == [256, 512]
    node_1 = cache.index.root.children[cache.keys(blocks(1))[0]]
    assert node_1.n_pages == 64 and node_1.state.position == 256
    # the fork's checkpoint is aligned down: a fork at 300 stores at 256
    cache = Cache()
    cache.serve(np.arange(600, dtype=np.int32))
    probe = cache.ckpts.probe(cache.keys(np.r_[np.arange(300), np.full(100, 9999)].astype(np.int32)), engine=0)
    assert probe.fork_tokens == 300 and cache.ckpts.store_target(400, probe.fork_tokens) == 256


def test_seed_scene_1_230_tokens_with_a_checkpoint_every_64_give_192():
    cache = Cache()
    tokens = np.arange(230, dtype=np.int32)
    cache.serve(tokens, every=64)
    assert cache.positions() == [64, 128, 192]  # the KV holds 57 full pages: 228 tokens
    assert cache.ckpts.probe(cache.keys(tokens), engine=0).kv_pages * PS == 228
    assert cache.usable(tokens) == 192


def test_seed_scene_2_280_tokens_give_256_or_192_when_256_is_a_tombstone():
    cache = Cache()
    tokens = np.arange(280, dtype=np.int32)
    cache.serve(tokens, every=64)
    assert cache.usable(tokens) == 256
    at = {c.position: c for c in cache.ckpts.checkpoints(HOST)}
    for pos in (64, 128, 192):
        cache.ckpts.touch(at[pos])  # 256 is now the least recently used
    (ev,) = cache.ckpts.evict(HOST, 1)
    assert ev.checkpoint is at[256] and ev.tombstone and ev.host_slot is not None
    assert at[256].node.state is None and at[256].node.host is None and 0 in at[256].node.device  # KV kept
    assert cache.usable(tokens) == 192


def test_seed_full_example_kv_match_goes_past_a_tombstone_to_the_deepest_checkpoint():
    # A [0..191] checkpoint; B [192..255] tombstone; C [256..319] checkpoint @320; request 0..279
    cache = Cache()
    tree = np.arange(320, dtype=np.int32)
    cache.serve(tree, every=64)
    at = {c.position: c for c in cache.ckpts.checkpoints(HOST)}
    cache.ckpts.drop(at[256], HOST)
    probe = cache.ckpts.probe(cache.keys(tree[:280]), engine=0)
    assert probe.kv_pages * PS == 280 and probe.usable_tokens == 192


def test_usable_prefix_never_goes_beyond_the_kv_match():
    cache = Cache()
    cache.serve(np.arange(256, dtype=np.int32))  # one checkpoint at 256
    # shares 250 tokens (62 full pages) with it: the checkpoint at 256 is out of reach
    probe = cache.ckpts.probe(cache.keys(np.r_[np.arange(250), [7] * 40].astype(np.int32)), engine=0)
    assert probe.kv_pages == 62 and probe.usable_tokens == 0 and probe.fork_tokens == 248
    # KV only on another engine's device: nothing is matched, so nothing is usable either
    idx = RadixIndex(PS, SALT, clock=Clock())
    ck = CheckpointIndex(idx, 64)
    toks = np.arange(128, dtype=np.int32)
    keys = page_keys(SALT, toks, PS)
    idx.insert(keys, toks, engine=1, device_pages=np.arange(1, 33, dtype=np.int64))
    ck.put(ck.node_for(keys, 128), host_slot=3)
    assert ck.probe(keys, engine=0).usable_tokens == 0
    assert ck.probe(keys, engine=1).usable_tokens == 128


def test_probe_matches_what_match_returns_on_random_trees():
    rng = np.random.default_rng(5)
    for _ in range(30):
        idx = RadixIndex(4, SALT, clock=Clock())
        ck = CheckpointIndex(idx, 8)
        seqs = [rng.integers(0, 3, rng.integers(4, 40), dtype=np.int32) for _ in range(8)]
        for s in seqs:
            keys = page_keys(SALT, s, 4)
            n = len(keys)
            if not n:
                continue
            kind = rng.integers(0, 3)
            if kind == 0:
                idx.insert(keys, s[:n * 4], engine=int(rng.integers(0, 2)), device_pages=np.arange(n, dtype=np.int64))
            elif kind == 1:
                idx.insert(keys, s[:n * 4], host_pages=np.arange(n, dtype=np.int64))
            else:
                idx.insert(keys, s[:n * 4], on_disk=True)
        for s in seqs:
            keys = page_keys(SALT, s, 4)
            for engine in (None, 0, 1):
                assert ck.probe(keys, engine).kv_pages == idx.match(keys, engine).num_pages


def test_checkpoint_eviction_is_its_own_lru_and_skips_locked_ones():
    cache = Cache()
    seqs = [np.r_[[i] * 64].astype(np.int32) for i in range(4)]
    for s in seqs:
        cache.serve(s)
    states = [cache.ckpts.node_for(cache.keys(s), 64).state for s in seqs]
    assert cache.ckpts.checkpoints(HOST) == states  # least recently used first
    cache.ckpts.touch(states[0])  # order now: 1, 2, 3, 0
    cache.ckpts.lock(states[1])
    evicted = cache.ckpts.evict(HOST, 2)
    assert [e.checkpoint for e in evicted] == [states[2], states[3]]
    assert all(e.tombstone for e in evicted)
    kv_pages = cache.index.num_pages(Tier.DEVICE)
    assert kv_pages == 64  # KV untouched by state eviction
    assert [cache.usable(s) for s in seqs] == [64, 64, 0, 0]
    cache.ckpts.unlock(states[1])
    assert [e.checkpoint for e in cache.ckpts.evict(HOST, 5)] == [states[1], states[0]]


def test_a_checkpoint_on_disk_survives_host_eviction():
    cache = Cache()
    toks = np.arange(64, dtype=np.int32)
    cache.serve(toks)
    node = cache.ckpts.node_for(cache.keys(toks), 64)
    ck, spare = cache.ckpts.put(node, on_disk=True)
    assert spare is None and ck.disk_key == checkpoint_disk_key(node.keys[-1])
    (ev,) = cache.ckpts.evict(HOST, 1)
    assert not ev.tombstone and ck.on_disk and ck.host_slot is None
    assert cache.usable(toks) == 64
    # a second host copy offered while one is there comes back as spare
    _, spare = cache.ckpts.put(node, host_slot=77)
    assert spare is None
    _, spare = cache.ckpts.put(node, host_slot=78)
    assert spare == 78
    assert cache.ckpts.drop(ck, DISK).tombstone is False
    assert cache.ckpts.evict(DISK, 1) == []


def test_removing_the_kv_node_hands_its_checkpoint_back_and_a_locked_one_only_at_unlock():
    idx = RadixIndex(PS, SALT, clock=Clock())
    cks = CheckpointIndex(idx, 64)
    a, b = np.arange(64, dtype=np.int32), np.arange(100, 164, dtype=np.int32)
    got = []
    for toks, slot in ((a, 5), (b, 6)):
        keys = page_keys(SALT, toks, PS)
        idx.insert(keys, toks, host_pages=np.arange(16, dtype=np.int64))
        got.append(cks.put(cks.node_for(keys, 64), host_slot=slot)[0])
    cks.lock(got[1])
    idx.evict(HOST, 100)  # both KV nodes were only on host: they leave the tree
    (removed,) = cks.take_removed()
    assert removed is got[0] and removed.host_slot == 5 and removed.removed
    assert cks.count(HOST) == 0
    cks.unlock(got[1])
    assert cks.take_removed() == [got[1]]
    with pytest.raises(IndexStateError):
        cks.unlock(got[1])


def test_split_keeps_a_checkpoint_at_its_position():
    cache = Cache()
    toks = np.arange(128, dtype=np.int32)
    cache.serve(toks)  # checkpoint at 128 on a node of 8 pages
    node = cache.ckpts.node_for(cache.keys(toks), 128)
    ck = node.state
    upper = cache.ckpts.node_for(cache.keys(toks), 64)  # splits the node at 64
    assert upper is not node and node.state is ck and node.n_pages == 16 and upper.state is None
    assert ck.position == 128 and cache.usable(toks) == 128
    check_invariants(cache.index)


def test_bad_input_changes_nothing():
    cache = Cache()
    toks = np.arange(128, dtype=np.int32)
    cache.serve(toks)
    keys = cache.keys(toks)
    with pytest.raises(IndexInputError):
        CheckpointIndex(cache.index, 42)  # not a multiple of the page size
    for pos in (0, 32, 192):
        with pytest.raises(IndexInputError):
            cache.ckpts.node_for(keys, pos)
    node = cache.index.node_ending_at(keys[:8])  # 32 tokens: not a chunk boundary
    with pytest.raises(IndexInputError):
        cache.ckpts.put(node, host_slot=1)
    assert node.state is None
    with pytest.raises(IndexInputError):
        cache.ckpts.put(cache.ckpts.node_for(keys, 64))  # no residency
    with pytest.raises(IndexInputError):
        cache.ckpts.evict(Tier.DEVICE, 1)
    assert cache.ckpts.node_for(cache.keys(np.arange(1000, 1128, dtype=np.int32)), 64) is None
    assert cache.positions() == [128]
