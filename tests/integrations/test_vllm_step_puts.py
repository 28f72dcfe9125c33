"""The vLLM scheduler side reserves a step's saves in one pipelined round trip (per rank),
against a real daemon and without an engine: the step's puts in request order, a request
whose pages are already on host saves nothing, and a daemon away gives no saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.layout import KVLayout

try:
    from hicache.integrations.vllm.layout import EngineShape, expected_arrangement
    from hicache.integrations.vllm.metadata import HiCacheWorkerMeta
    from hicache.integrations.vllm.scheduler import SchedulerSide
except ImportError:
    import os

    if os.environ.get("CI"):
        raise
    pytest.skip("vLLM is not installed", allow_module_level=True)

PS = 32
NUM_BLOCKS = 64
LAYOUT = KVLayout("mha", 2, PS, "float32", num_kv_heads=2, head_dim=32)


def request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, prompt_embeds=None, lora_request=None,
                           cache_salt=None, mm_features=[], num_prompt_tokens=len(tokens))


def step(new: list[tuple[SimpleNamespace, list[int]]]) -> SimpleNamespace:
    """vLLM's SchedulerOutput for a step prefilling each new request whole."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0, block_ids=(blocks,))
                            for r, blocks in new],
        num_scheduled_tokens={r.request_id: len(r.all_token_ids) for r, _ in new}, preempted_req_ids=None,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[],
                                              resumed_req_ids=set()))


def admit(sched: SchedulerSide, req: SimpleNamespace, blocks: list[int]) -> None:
    n, _ = sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, (blocks,), n or 0)


@pytest.fixture
def sched(daemon):
    shape = EngineShape("m", LAYOUT, 1, "cpu", expected_arrangement(False, PS, 2, 32, "float32"))
    s = SchedulerSide(shape, NUM_BLOCKS, daemon.socket)
    yield s
    s.close()


def test_a_steps_puts_are_one_round_trip_in_request_order(sched):
    c = sched.clients[0]
    shared = list(range(1, 129))  # 4 pages a third request already finds on host
    plan = c.put(shared)
    assert c.put_done(plan) == 4
    # block 0 is vLLM's null block (a sliding window's freed one): never a request's here
    reqs = [(request("a", list(range(1000, 1100))), [1, 2, 3, 4]),  # 3 full pages, a partial one
            (request("b", list(range(5000, 5160))), [5, 6, 7, 8, 9]),  # 5 full pages
            (request("c", shared), [10, 11, 12, 13])]  # all on host: nothing to save
    for r, blocks in reqs:
        admit(sched, r, blocks)
    trips, puts = c.round_trips, c.calls["put"]
    meta = sched.build_meta(step(reqs))
    assert c.round_trips == trips + 1 and c.calls["put"] == puts + 3
    assert [(s.req_id, s.block_ids, len(s.host_pages)) for s in meta.saves] == [
        ("a", [[1, 2, 3]], 3), ("b", [[5, 6, 7, 8, 9]], 5)]
    assert [sched.reqs[r].saved_pages for r in "abc"] == [3, 5, 4]
    hosts = [p for s in meta.saves for p in s.host_pages]
    assert len(set(hosts)) == 8
    assert sched.has_pending_saves()
    # the workers report the copies done: the puts finish (posted) and the pages are on host
    sched.on_output(HiCacheWorkerMeta(saved={s.put_id: True for s in meta.saves}))
    assert not sched.has_pending_saves()
    assert c.match(list(range(5000, 5160))).host_len == 5


def test_a_daemon_away_gives_the_step_no_saves(sched, daemon):
    reqs = [(request("a", list(range(1000, 1100))), [1, 2, 3, 4]),
            (request("b", list(range(5000, 5160))), [5, 6, 7, 8, 9])]
    for r, blocks in reqs:
        admit(sched, r, blocks)
    daemon.stop()
    meta = sched.build_meta(step(reqs))
    assert meta.saves == [] and sched.clients[0].outages == 1 and not sched.has_pending_saves()
