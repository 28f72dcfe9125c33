"""The vLLM connector on a hybrid model: vLLM keeps its hybrid KV cache manager on with
hicache (`SupportsHMA`), and hicache stores and restores every KV cache group.

The model is a tiny Llama with seeded random weights whose even layers attend to a
64-token sliding window and odd layers to everything: vLLM's CPU platform runs it with
two KV cache groups (SlidingWindowSpec, FullAttentionSpec), and frees the sliding
window's blocks behind the window while a request runs. Prompts are several windows
long. The outputs of vLLM without the connector are the reference:

1. with the connector vLLM keeps the hybrid manager on, the outputs are equal, and after
   vLLM's own prefix cache is cleared every prompt's full blocks come from hicache;
2. garbling the loaded blocks changes the outputs (the restored KV is used);
3. loads that fail are recomputed by vLLM (per request: block ids are per group), with
   equal outputs;
4. a tiny Jamba (Mamba layers beside attention; vLLM's CPU platform builds its KV cache
   config with a MambaSpec group) is refused at start with the group named;
and, with a real daemon but no engine, what the scheduler side does with blocks a window
freed (such a page is not stored, so never offered) and which groups it refuses.

Under CI=true a missing vLLM fails the suite instead of skipping it.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.vllm_required import PATIENT  # skips, or fails under CI, without vLLM

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from hicache.bench.engines.tiny_llama import build_tiny_llama  # noqa: E402
from hicache.client.connection import RpcConnection  # noqa: E402
from hicache.daemon.serve.launcher import LocalDaemon  # noqa: E402
from hicache.integrations.vllm.layout import UnsupportedModel, engine_shape  # noqa: E402
from hicache.integrations.vllm.metadata import HiCacheWorkerMeta  # noqa: E402
from hicache.integrations.vllm.saves import SAVE_RETRIES  # noqa: E402
from tests.wait import wait_until  # noqa: E402
from hicache.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from hicache.integrations.vllm_driver import run_in_process  # noqa: E402

BLOCK = 32
WINDOW = 64
NUM_BLOCKS = 64


def prompts() -> list[list[int]]:
    """A shared prefix of 9 blocks (4.5 windows) and different tails."""
    rng = random.Random(11)
    system = [rng.randrange(1, 500) for _ in range(9 * BLOCK + 5)]
    return [system + [rng.randrange(1, 500) for _ in range(40 + 13 * i)] for i in range(3)]


def full_blocks(p: list[int]) -> int:
    return min(len(p) // BLOCK * BLOCK, len(p) - 1)  # every full block, short of the last token


MODEL_DIR: Path = Path()


def run_vllm(tmp: Path, name: str, **spec) -> dict:
    spec = {"model": str(MODEL_DIR), "block_size": BLOCK, "max_tokens": 8, **spec}
    if spec.get("socket"):
        spec.setdefault("extra_config", PATIENT)  # hit counts exact on a loaded machine
    return run_in_process(spec, tmp, name, timeout_s=600)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    global MODEL_DIR
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    MODEL_DIR = build_tiny_llama(tmp / "tiny-swa-llama", layers=4, sliding_window=WINDOW)
    return tmp


@pytest.fixture(scope="module")
def reference(work):
    ps = prompts()
    r = run_vllm(work, "reference", socket=None, rounds=[ps])
    assert r["hybrid_kv_cache_manager"]  # vLLM runs this model with its hybrid manager
    return r["rounds"][0]["outputs"]


@pytest.fixture(scope="module")
def daemon(work):
    d = LocalDaemon(work / "daemon", "--host-capacity", "256MiB", "--no-disk")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def hybrid_run(work, daemon):
    """Two rounds with the connector (vLLM's own cache cleared between them); it leaves every
    prompt's pages in the daemon for the tests after it."""
    ps = prompts()
    return run_vllm(work, "hybrid", socket=daemon.socket, rounds=[ps, ps])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hybrid_model_outputs_equal_and_every_group_restored(reference, hybrid_run):
    ps = prompts()
    r = hybrid_run
    assert r["hybrid_kv_cache_manager"]  # not turned off for the connector
    first, second = r["rounds"]
    assert first["outputs"] == reference
    assert second["outputs"] == reference
    # vLLM's own cache was cleared between rounds: every full block came from hicache
    assert second["cached"] == [full_blocks(p) for p in ps]
    c = r["counters"]
    assert c["vllm:hicache_loaded_tokens"] == c["vllm:external_prefix_cache_hits"] > 0
    assert c["vllm:hicache_load_error_blocks"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hybrid_corrupted_loads_change_outputs(work, reference, daemon, hybrid_run):
    """The proof above can fail: garbling the loaded blocks of both groups changes the outputs."""
    ps = prompts()
    r = run_vllm(work, "hybrid-corrupt", socket=daemon.socket, rounds=[ps], corrupt_load=True)
    assert r["rounds"][0]["cached"] == [full_blocks(p) for p in ps]  # the loads did happen
    assert r["rounds"][0]["outputs"] != reference


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hybrid_failed_loads_are_recomputed(work, reference, daemon, hybrid_run):
    """Every load fails halfway through its layers: vLLM takes each request back (failed
    receive) and computes it, never using the half-loaded blocks."""
    ps = prompts()
    r = run_vllm(work, "hybrid-fail", socket=daemon.socket, rounds=[ps], fail_load=True)
    assert r["rounds"][0]["outputs"] == reference
    assert r["counters"]["vllm:hicache_load_error_blocks"] > 0
    assert r["counters"].get("vllm:hicache_loaded_tokens", 0) == 0


def build_tiny_jamba(path: Path) -> Path:
    """Mamba (even layers) and attention (odd layers), random weights, no hub."""
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                      num_experts=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16,
                      mamba_dt_rank=8, max_position_embeddings=4096, torch_dtype="float32",
                      tie_word_embeddings=False, use_mamba_kernels=False)
    torch.manual_seed(0)
    JambaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mamba_hybrid_is_refused_at_start(work, daemon):
    model = build_tiny_jamba(work / "tiny-jamba")
    with pytest.raises(RuntimeError):
        run_vllm(work, "jamba", model=str(model), socket=daemon.socket, rounds=[prompts()[:1]])
    log = (work / "jamba.log").read_text()  # the whole output (the error carries only its tail)
    assert "UnsupportedModel: hicache's vLLM connector caches hybrid models" in log
    assert "KV cache group 0 (MambaSpec, layers model.layers.0.mixer" in log


# -- the adapter with vLLM's spec classes and a real daemon (no engine) -------------------------
def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                           model_config=SimpleNamespace(model="/models/swa", hf_text_config=SimpleNamespace()))


def attn(window: int | None = None, **kw) -> FullAttentionSpec | SlidingWindowSpec:
    args = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32} | kw
    return SlidingWindowSpec(sliding_window=window, **args) if window else FullAttentionSpec(**args)


def hybrid_config(*groups: tuple[list[int], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in layers], spec) for layers, spec in groups])


def test_hybrid_shape_pages_every_layer_in_order():
    shape = engine_shape(vllm_config(), hybrid_config(([0, 2], attn(WINDOW)), ([1, 3], attn())))
    assert shape.is_hybrid and shape.layout.num_layers == 4
    assert shape.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    assert shape.group_of_layer == (0, 1, 0, 1) and shape.windows == (WINDOW, None)
    assert shape.extra_key().endswith("/layers=w64,full,w64,full")
    single = engine_shape(vllm_config(), hybrid_config(([0, 1, 2, 3], attn())))
    assert not single.is_hybrid and "layers=" not in single.extra_key()  # single-group namespaces unchanged


def test_hybrid_groups_hicache_cannot_restore_are_refused_at_start():
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(UnsupportedModel, match="Mamba"):
        engine_shape(vllm_config(), hybrid_config(([0, 2], mamba), ([1, 3], attn())))
    with pytest.raises(UnsupportedModel, match="one page shape"):
        engine_shape(vllm_config(), hybrid_config(([0, 2], attn(WINDOW, head_size=64)), ([1, 3], attn())))
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedModel, match="not"):
        engine_shape(vllm_config(), hybrid_config(([0, 2], mla), ([1, 3], attn(WINDOW))))


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, prompt_embeds=None, lora_request=None,
                           cache_salt=None, mm_features=[])


def _step(rid: str, computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={rid: scheduled}, preempted_req_ids=None,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[rid], num_computed_tokens=[computed],
                                                                 new_block_ids=[None], resumed_req_ids=set()))


IDLE = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=None,
                      scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[],
                                                            resumed_req_ids=set()))


def _ask(sched: SchedulerSide, req: SimpleNamespace) -> tuple[int, bool]:
    """get_num_new_matched_tokens, asked again each (idle) step until answered."""
    got: list[tuple[int | None, bool]] = []
    wait_until(lambda: (got.append(sched.num_new_matched_tokens(req, 0)), got[-1][0] is not None
                        or sched.build_meta(IDLE) is None)[1], 30, "the lookup's answer")
    return got[-1]  # type: ignore[return-value]


def test_pages_whose_window_block_was_freed_are_not_stored_nor_offered(tmp_path):
    """Request a's sliding-window group lost the blocks of its first 4 pages (vLLM's null
    block, 0): its put is given back, no save is planned (ever, after the retries), and a
    later request with the same prefix is offered nothing. Request b holds every block: its
    save copies each group's own blocks, and a load skips the blocks its window does not need."""
    shape = engine_shape(vllm_config(), hybrid_config(([0, 2], attn(WINDOW)), ([1, 3], attn())))
    tokens = list(range(1, 200))  # 6 full pages
    with LocalDaemon(tmp_path / "d", "--host-capacity", "64MiB", "--no-disk") as d:
        sched = SchedulerSide(shape, NUM_BLOCKS, d.socket)
        a = _request("a", tokens)
        assert _ask(sched, a) == (0, False)  # nothing stored yet
        sched.after_alloc(a, ([0, 0, 0, 0, 5, 6], [11, 12, 13, 14, 15, 16]), 0)
        for _ in range(SAVE_RETRIES + 2):
            assert sched.build_meta(_step("a", 150, 49)).saves == []
        puts = wait_until(lambda: (p := RpcConnection.one_call(d.socket, "stats")["puts"])["failed"]
                          == SAVE_RETRIES + 1 and p, 30, "the given-back puts")
        assert puts["committed_pages"] == 0
        assert _ask(sched, _request("a2", tokens)) == (0, False)

        b = _request("b", tokens[:-1] + [7])
        assert _ask(sched, b) == (0, False)
        sched.after_alloc(b, ([21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]), 0)
        (save,) = sched.build_meta(_step("b", 150, 49)).saves
        assert save.block_ids == [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
        sched.on_output(HiCacheWorkerMeta({save.put_id: True}))  # the workers' report: copied

        c = _request("c", tokens[:-1] + [7])
        sched.build_meta(IDLE)  # the step that sends b's report
        n, load_async = _ask(sched, c)
        assert (n, load_async) == (6 * BLOCK, True)  # hybrid loads are asynchronous
        sched.after_alloc(c, ([0, 0, 0, 44, 45, 46], [51, 52, 53, 54, 55, 56]), n)
        (load,) = sched.build_meta(_step("c", 0, 0)).loads
        assert not load.stale
        assert load.block_ids == [[-1, -1, -1, 44, 45, 46], [51, 52, 53, 54, 55, 56]]
        sched.close()
