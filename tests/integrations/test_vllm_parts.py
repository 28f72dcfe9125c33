"""The vLLM connector's parts without a running engine: block copies through a real
arena (MHA and MLA arrangements), request keys with extras, and what configurations
the connector accepts (with vLLM's own KV cache spec classes)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.errors import LayoutError
from hicache.index.keys import page_keys
from hicache.integrations.block_copy import BlockCopier, arrangement
from hicache.integrations.request_keys import RequestKeys
from hicache.layout import KVLayout
from hicache.tiers.host.arena import HostArena

try:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from hicache.integrations.vllm.layout import UnsupportedModel, engine_shape
except ImportError:
    if os.environ.get("CI"):
        raise
    FullAttentionSpec = None

NUM_BLOCKS = 12


def caches_for(layout: KVLayout, *, seed: int) -> list[torch.Tensor]:
    """vLLM's per-layer [B, H, N, C] views, random bytes: MHA C = 2*head, MLA H = 1."""
    dtype = getattr(torch, layout.dtype)
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.k_heads, layout.page_size, layout.k_dim + layout.v_dim)
    out = []
    for _ in range(layout.num_layers):
        raw = torch.randint(0, 256, (int(np.prod(shape)) * layout.itemsize,), dtype=torch.uint8, generator=g)
        out.append(raw.view(dtype).reshape(shape).clone())
    return out


LAYOUTS = {
    "mha-f32": KVLayout("mha", 3, 32, "float32", num_kv_heads=2, head_dim=32),
    "mha-bf16": KVLayout("mha", 2, 32, "bfloat16", num_kv_heads=4, head_dim=64),
    "mla-bf16": KVLayout("mla", 2, 32, "bfloat16", kv_lora_rank=512, qk_rope_head_dim=64),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_save_then_load_per_layer_is_bit_exact(name):
    layout = LAYOUTS[name]
    with HostArena.create(64 * layout.page_bytes, mlock=False) as arena:
        src = caches_for(layout, seed=1)
        saver = BlockCopier(src, NUM_BLOCKS, layout, arena)
        saver.save([3, 1, 7], [5, 2, 9])
        dst = [torch.zeros_like(t) for t in src]
        loader = BlockCopier(dst, NUM_BLOCKS, layout, arena)
        for layer in range(layout.num_layers):
            loader.load_layer(layer, [0, 4, 8], [5, 2, 9])
            for later in range(layer + 1, layout.num_layers):  # one layer at a time
                assert not dst[later].any()
        for s, d in zip(src, dst):
            assert torch.equal(d[[0, 4, 8]].view(torch.uint8), s[[3, 1, 7]].view(torch.uint8))
            others = [b for b in range(NUM_BLOCKS) if b not in (0, 4, 8)]
            assert not d[others].any()


def test_a_strided_view_round_trips_too():
    """A backend whose physical order differs hands a strided view: same bytes back."""
    layout = LAYOUTS["mha-f32"]
    with HostArena.create(16 * layout.page_bytes, mlock=False) as arena:
        base = caches_for(layout, seed=2)
        strided = [t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3) for t in base]  # H outermost
        BlockCopier(strided, NUM_BLOCKS, layout, arena).save([2, 11], [0, 1])
        out = [torch.zeros_like(t).permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3) for t in base]
        loader = BlockCopier(out, NUM_BLOCKS, layout, arena)
        for layer in range(layout.num_layers):
            loader.load_layer(layer, [2, 11], [0, 1])
        for b, o in zip(base, out):
            assert torch.equal(o[[2, 11]].view(torch.uint8), b[[2, 11]].view(torch.uint8))  # NaNs compare too


def test_bad_ids_and_unmapped_pages_copy_nothing():
    layout = LAYOUTS["mha-f32"]
    with HostArena.create(8 * layout.page_bytes, mlock=False) as arena:
        caches = caches_for(layout, seed=3)
        before = [t.clone() for t in caches]
        c = BlockCopier(caches, NUM_BLOCKS, layout, arena)
        for blocks, pages in (([NUM_BLOCKS], [0]), ([0], [8 * 4096]), ([0, 1], [0]), ([-1], [0])):
            with pytest.raises(LayoutError):
                c.load_layer(0, blocks, pages)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, before))
    arena = HostArena.reserve(4, 1 << 20)  # an engine's view before any slab is mapped
    try:
        c = BlockCopier(caches, NUM_BLOCKS, layout, arena)
        with pytest.raises(LayoutError, match="outside the slabs"):
            c.save([0], [0])
    finally:
        arena.close()


def test_block_bytes_must_match_the_layout():
    layout = LAYOUTS["mha-f32"]
    wrong = KVLayout("mha", 3, 32, "float32", num_kv_heads=1, head_dim=32)
    with HostArena.create(8 * layout.page_bytes, mlock=False) as arena:
        with pytest.raises(LayoutError, match="bytes per layer"):
            BlockCopier(caches_for(layout, seed=4), NUM_BLOCKS, wrong, arena)


def test_request_keys_share_plain_prefixes_and_separate_extras():
    salt, ps = b"s" * 16, 8
    toks = np.arange(100)
    plain = page_keys(salt, toks[:96], ps)
    assert RequestKeys(salt, ps).upto(toks, 12) == plain
    grown = RequestKeys(salt, ps)
    grown.upto(toks, 3)
    assert grown.upto(toks, 12) == plain  # extended as the request decodes
    # an adapter or a cache salt changes every page
    for extras in (["lora=a"], ["cache_salt=t1"]):
        keys = RequestKeys(salt, ps, extras=extras).upto(toks, 12)
        assert not set(keys) & set(plain)
    assert RequestKeys(salt, ps, extras=["lora=a"]).upto(toks, 4) != RequestKeys(salt, ps, extras=["lora=b"]).upto(toks, 4)
    # an image over tokens 20..29 (pages 2 and 3): pages before it are shared, from it on not
    img_a = RequestKeys(salt, ps, items=[("img-a", 20, 10)]).upto(toks, 12)
    img_b = RequestKeys(salt, ps, items=[("img-b", 20, 10)]).upto(toks, 12)
    assert img_a[:2] == plain[:2] and img_b[:2] == plain[:2]
    assert not set(img_a[2:]) & set(plain[2:]) and not set(img_a[2:]) & set(img_b[2:])
    assert RequestKeys(salt, ps, items=[("img-a", 20, 10)]).upto(toks, 12) == img_a


needs_vllm = pytest.mark.skipif(FullAttentionSpec is None, reason="vLLM is not installed")


def vllm_config(tp: int = 1, pp: int = 1, **hf) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           model_config=SimpleNamespace(model="/models/m", hf_text_config=SimpleNamespace(**hf)))


def kv_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], s)
                                          for s in specs])


@needs_vllm
def test_engine_shape_mha_and_mla():
    mha = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    shape = engine_shape(vllm_config(tp=2), kv_config(mha))
    assert shape.layout == KVLayout("mha", 2, 32, "float32", num_kv_heads=2, head_dim=32)
    assert shape.arrangement == "B,2,32,64:float32" and shape.namespace_rank(1) == (1, 2)
    assert arrangement(caches_for(shape.layout, seed=0)[0], NUM_BLOCKS) == shape.arrangement
    assert shape.stores(1)
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    shape = engine_shape(vllm_config(tp=4, kv_lora_rank=512, qk_rope_head_dim=64), kv_config(mla), "dsv2")
    assert shape.layout == LAYOUTS["mla-bf16"] and shape.model == "dsv2"
    assert shape.arrangement == "B,1,32,576:bfloat16"
    assert arrangement(caches_for(shape.layout, seed=0)[0], NUM_BLOCKS) == shape.arrangement
    assert shape.namespace_rank(3) == (0, 1) and not shape.stores(3) and shape.stores(0)


@needs_vllm
def test_engine_shape_refuses_what_it_cannot_cache():
    mha = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(UnsupportedModel, match="pipeline parallelism"):
        engine_shape(vllm_config(pp=2), kv_config(mha))
    window = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    with pytest.raises(UnsupportedModel, match="full-attention"):
        engine_shape(vllm_config(), kv_config(window))
    int8 = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.int8)
    with pytest.raises(UnsupportedModel, match="dtype int8"):
        engine_shape(vllm_config(), kv_config(int8))


def test_without_vllm_the_import_error_names_the_extra():
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None\n"
            "try:\n    import hicache.integrations.vllm\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "pip install 'hicache[vllm]'" in out


@needs_vllm
def test_a_reconnect_between_match_and_step_makes_the_load_stale(tmp_path):
    """The scheduler matched (page ids of one daemon's arena), then its client reconnected to a
    restarted daemon before the step's metadata was built: the workers must not copy those ids."""
    from hicache.daemon.serve.launcher import LocalDaemon
    from hicache.integrations.vllm.layout import EngineShape, expected_arrangement
    from hicache.integrations.vllm.scheduler import SchedulerSide
    from tests.wait import wait_until

    layout = KVLayout("mha", 2, 32, "float32", num_kv_heads=2, head_dim=32)
    shape = EngineShape("m", layout, 1, "cpu", expected_arrangement(False, 32, 2, 32, "float32"))
    tokens = list(range(1, 200))
    req = SimpleNamespace(request_id="r", all_token_ids=tokens, prompt_embeds=None, lora_request=None,
                          cache_salt=None, mm_features=[])
    idle = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=None,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                                 new_block_ids=[], resumed_req_ids=set()))
    with LocalDaemon(tmp_path / "d", "--host-capacity", "64MiB", "--no-disk") as d:
        sched = SchedulerSide(shape, NUM_BLOCKS, d.socket)
        c = sched.clients[0]
        plan = c.put(tokens[:192])
        assert c.put_done(plan) == 6
        got: list[int | None] = []
        # vLLM asks again each step until the answer is in (the step's metadata sends the match)
        wait_until(lambda: got.append(sched.num_new_matched_tokens(req, 0)[0]) or got[-1] is not None
                   or sched.build_meta(idle) is None, 30, "the lookup's answer")
        n = got[-1]
        assert n == 6 * 32
        sched.after_alloc(req, (list(range(6)),), n)
        first = c.instance
        d.stop()
        d.start()
        c.match(tokens)  # fails: the breaker opens and the probe reconnects
        wait_until(c.poll, 30, "the client to reconnect")
        assert c.instance != first
        meta = sched.build_meta(idle)
        assert meta.instances == {0: c.instance}
        assert [(s.stale, s.host_pages, s.block_ids) for s in meta.loads] == [(True, {}, [list(range(6))])]
        sched.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the copy CPUs apart")
def test_the_worker_gives_its_arena_the_copy_threads_cpus(tmp_path, monkeypatch):
    """The arena's pre-faults (slabs the worker maps as stores come) run where the copy
    thread does, off the forward pass's cores."""
    from hicache.daemon.serve.launcher import LocalDaemon
    from hicache.integrations.vllm.layout import EngineShape, expected_arrangement
    from hicache.integrations.vllm.worker import WorkerSide

    copy_cpu = max(os.sched_getaffinity(0))
    monkeypatch.setenv("HICACHE_COPY_CPUS", str(copy_cpu))
    layout = LAYOUTS["mha-f32"]
    shape = EngineShape("m", layout, 1, "cpu", expected_arrangement(False, 32, 2, 32, "float32"))
    with LocalDaemon(tmp_path / "d", "--host-capacity", "64MiB", "--no-disk") as d:
        w = WorkerSide(shape, NUM_BLOCKS, d.socket, 0)
        try:
            w.register({f"layers.{i}.attn": t for i, t in enumerate(caches_for(layout, seed=3))},
                       lambda n: int(n.split(".")[1]))
            assert w.client.arena is not None and w.client.arena.prefault_cpus == {copy_cpu}
        finally:
            w.close()
