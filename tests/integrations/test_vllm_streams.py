"""The vLLM worker's CUDA path without a GPU: its ordering logic, with a recorder standing
in for the CUDA stream/event API (tests/integrations/cuda_recorder.py) and the real
copies (BlockCopier's Triton kernel in the interpreter) into a real daemon's arena.

- loads: the load stream waits for the step's stream, each layer's event is recorded
  after that layer's copy, and `wait_for_layer` makes the step's stream wait on that
  layer's event only;
- saves: never issued on the step's stream; the save stream waits on an event recorded
  on the step's stream after the forward pass; a save (and a load) is reported only
  after its event completed;
- a load that fails is reported through the load errors in the same step;
- blocks vLLM may reuse (preemption) are ordered on the GPU, the host never waits.

Triton's interpreter must be chosen before the first kernel is built, so the tests run
in a child pytest with TRITON_INTERPRET=1 (`test_the_stream_path_under_the_interpreter`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tests.integrations.vllm_required  # noqa: F401  (skips without vLLM, except in CI)
import torch

from hicache.integrations.vllm.layout import EngineShape, expected_arrangement
from hicache.integrations.vllm.metadata import HiCacheMeta, LoadSpec, SaveSpec
from hicache.integrations.vllm.worker import WorkerSide
from hicache.kernels import copy_triton, triton_env
from hicache.layout import KVLayout
from tests.integrations.cuda_recorder import StreamRecorder

REPO = Path(__file__).resolve().parents[2]
CHILD = triton_env.interpreter_enabled()
child_only = pytest.mark.skipif(not CHILD, reason="runs in the child test_the_stream_path_under_the_interpreter starts")

NUM_BLOCKS, LAYERS, HEADS, BLOCK, HEAD = 13, 3, 2, 16, 32
LAYOUT = KVLayout("mha", LAYERS, BLOCK, "bfloat16", num_kv_heads=HEADS, head_dim=HEAD)


def test_the_stream_path_under_the_interpreter():
    if CHILD:
        pytest.skip("this is the child")
    if not triton_env.triton_installed():
        if os.environ.get("CI"):
            raise AssertionError("triton is not installed (scripts/setup.sh installs it with torch)")
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory(prefix="hc-") as tmp:  # short: the daemons' sockets live there
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                               "--basetemp", os.path.join(tmp, "t"), "-k", "not under_the_interpreter"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]


def vllm_caches(seed: int) -> list[torch.Tensor]:
    """vLLM 0.32's CUDA default (LBNHC): a block stored token-major [N, H, C], handed to
    connectors as the [B, H, N, C] view. Random bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = [torch.randint(-2**15, 2**15, (NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD), dtype=torch.int16, generator=g)
           for _ in range(LAYERS)]
    return [r.view(torch.bfloat16).permute(0, 2, 1, 3) for r in raw]


def block_bytes(t: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    return t[blocks].reshape(len(blocks), -1).contiguous().view(torch.uint8)


@pytest.fixture
def setup(daemon, monkeypatch):
    """(worker, recorder, caches): a worker on the stream path over a real daemon."""
    rec = StreamRecorder()
    monkeypatch.setattr(copy_triton, "copy_block_runs", rec.spy(copy_triton.copy_block_runs))
    shape = EngineShape("m", LAYOUT, 1, "cuda", expected_arrangement(False, BLOCK, HEADS, HEAD, "bfloat16"))
    w = WorkerSide(shape, NUM_BLOCKS, daemon.socket, 0, stream_api=rec, copy_method="triton")
    caches = vllm_caches(seed=1)
    w.register({f"layers.{i}.attn": t for i, t in enumerate(caches)}, lambda n: int(n.split(".")[1]))
    assert w.streams is not None and w.copier is not None and w.copier.method == "triton"
    rec.take()
    yield w, rec, caches
    w.close()


def reserve(w: WorkerSide, first_token: int, pages: int):
    plan = w.client.put(list(range(first_token, first_token + pages * BLOCK)))
    assert plan is not None and plan.put is not None and len(plan.host_pages) == pages
    return plan


def meta_for(w: WorkerSide, **kw) -> HiCacheMeta:
    return HiCacheMeta(instances={0: w.client.instance}, slabs={0: w.client.slab_version}, **kw)


@child_only
def test_saves_wait_for_the_forward_pass_and_are_reported_once_complete(setup):
    w, rec, caches = setup
    plan = reserve(w, 1, 4)
    pages = plan.host_pages.tolist()
    w.start_saves(meta_for(w, saves=[SaveSpec("a", 0, plan.put, [[3, 7, 1, 12]], pages)]))
    log = rec.take()
    (_, forward, on), *rest = log
    assert on == "step" and rest[0] == ("wait_event", "save", forward)  # after the forward pass's writes
    copies = [e for e in log if e[0] == "copy"]
    assert copies == [("copy", "save")]  # one launch for every layer, never on the step's stream
    assert log[-1][0] == "record" and log[-1][2] == "save" and log.index(copies[0]) < len(log) - 1
    done = log[-1][1]
    assert w.worker_meta() is None and w.take_stats() is None  # not complete: not reported
    rec.complete()
    reported = w.worker_meta()
    assert reported is not None and reported.saved == {plan.put: True}
    assert w.take_stats().data["saved_tokens"] == 4 * BLOCK
    host = w.copier.host[torch.tensor(pages)]  # [page, layer, bytes]: the real kernel's bytes
    for layer, t in enumerate(caches):
        assert torch.equal(host[:, layer], block_bytes(t, [3, 7, 1, 12]))
    w.before_step(HiCacheMeta(preempted=True))  # blocks vLLM freed: ordered on the GPU, no host wait
    assert rec.take() == [("wait_event", "step", done)]


@child_only
def test_loads_are_awaited_per_layer_on_the_step_stream(setup):
    w, rec, caches = setup
    plan = reserve(w, 1000, 3)
    pages = plan.host_pages.tolist()
    w.copier.save([2, 8, 11], pages)  # the pages' bytes, off the recorder's log
    rec.take()
    w.start_load(meta_for(w, loads=[LoadSpec("b", [[0, 5, 9]], {0: pages})]))
    log = rec.take()
    assert log[0] == ("wait_stream", "load", "step")  # the new blocks may still be read by queued work
    on_load = [e for e in log[1:] if e[0] == "copy" or (e[0] == "record" and e[2] == "load")]
    assert len(on_load) == len(log) - 1  # everything else happens on the load stream
    # a timing event, then per layer its copy and its event, then the done event
    assert [e[0] for e in on_load] == ["record"] + ["copy", "record"] * LAYERS + ["record"]
    layer_events = [on_load[2 + 2 * layer][1] for layer in range(LAYERS)]
    for layer in (1, 0, 2):
        w.wait_for_layer(f"layers.{layer}.attn")
        assert rec.take() == [("wait_event", "step", layer_events[layer])]  # that layer's event only
    for t in caches:
        assert torch.equal(block_bytes(t, [0, 5, 9]), block_bytes(t, [2, 8, 11]))
    assert w.worker_meta() is None  # the pins stay until the copies completed
    rec.complete()
    reported = w.worker_meta()
    assert reported is not None and reported.loaded == {"b"} and not w.load_errors()
    w.start_saves(meta_for(w))
    assert not [e for e in rec.take() if e[0] in ("synchronize", "copy")]


@child_only
def test_a_failed_load_is_reported_in_its_step(setup):
    w, rec, caches = setup
    plan = reserve(w, 2000, 2)
    outside = [plan.host_pages[0], 10**7]  # a page no slab here holds
    before = [block_bytes(t, [4, 6]).clone() for t in caches]
    w.start_load(meta_for(w, loads=[LoadSpec("c", [[4, 6]], {0: outside})]))
    assert w.load_errors() == {4, 6}  # this step: vLLM recomputes them
    log = rec.take()
    assert not [e for e in log if e[0] == "copy"]
    recorded = [e[1] for e in log if e[0] == "record"]
    assert len(recorded) == LAYERS + 2  # every layer's event still recorded: waiting on them is sound
    w.wait_for_layer("layers.2.attn")
    assert rec.take() == [("wait_event", "step", recorded[3])]
    assert all(torch.equal(block_bytes(t, [4, 6]), b) for t, b in zip(caches, before))
    assert w.worker_meta() is None
    rec.complete()
    assert w.worker_meta().loaded == {"c"}
    assert w.take_stats().data["load_errors"] == 2


@child_only
def test_close_waits_for_the_copies_in_flight(setup):
    w, rec, caches = setup
    plan = reserve(w, 3000, 2)
    w.start_saves(meta_for(w, saves=[SaveSpec("d", 0, plan.put, [[5, 6]], plan.host_pages.tolist())]))
    done = rec.take()[-1][1]
    w.drain()  # as on a daemon restart and at shutdown: the host blocks until the copies are done
    assert ("synchronize", done) in rec.take()
    assert w.worker_meta().saved == {plan.put: True}


def test_the_recorder_refuses_what_it_does_not_stand_in_for():
    rec = StreamRecorder()
    with pytest.raises(AssertionError, match="torch.cuda.synchronize"):
        rec.synchronize()
    s = rec.Stream(None)
    with pytest.raises(AssertionError, match="Stream.synchronize"):
        s.synchronize()
    with pytest.raises(AssertionError, match="never recorded"):
        rec.Event().query()
