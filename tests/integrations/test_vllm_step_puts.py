"""The vLLM scheduler side against a real daemon and without an engine: nothing it does
on a step waits for the daemon. Lookups answer "ask again" until the match is in, then
the pages every rank holds on host (a block-aligned prompt all of them, short of its last
token); a step's puts go out in one write per rank and become the workers' plans on the
next step, in request order; a daemon away, slow or stopped costs no step a wait and
loses no connection.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from hicache.layout import KVLayout
from tests.wait import wait_until

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


IDLE = step([])


def ask(sched: SchedulerSide, req: SimpleNamespace, local: int = 0) -> int:
    """vLLM's get_num_new_matched_tokens, asked again each step (an idle step's metadata in
    between, which sends what the step asked: the clients are corked until then) until
    answered."""
    got: list[int] = []

    def answered() -> bool:
        n, _ = sched.num_new_matched_tokens(req, local)
        if n is not None:
            got.append(n)
            return True
        sched.build_meta(IDLE)
        return False
    wait_until(answered, 30, "the lookup's answer")
    return got[0]


def admit(sched: SchedulerSide, req: SimpleNamespace, blocks: list[int]) -> int:
    n = ask(sched, req)
    sched.after_alloc(req, (blocks,), n)
    return n


def answered_saves(sched: SchedulerSide, so: SimpleNamespace) -> list:
    """The copy plans of puts sent on an earlier step, from the first step that has them."""
    metas = []
    wait_until(lambda: metas.append(sched.build_meta(so)) or metas[-1].saves, 30, "the puts' answers")
    return metas[-1].saves


SHAPE = EngineShape("m", LAYOUT, 1, "cpu", expected_arrangement(False, PS, 2, 32, "float32"))


@pytest.fixture
def sched(daemon):
    """A scheduler side that waits for every answer as long as a loaded machine may need: its
    declared prefill rate makes each lookup worth waiting for (the tests count hits)."""
    s = SchedulerSide(SHAPE, NUM_BLOCKS, daemon.socket, prefill_tokens_per_s=1.0)
    yield s
    s.close()



def test_a_steps_puts_are_one_write_planned_on_the_next_step_in_request_order(sched):
    c = sched.clients[0]
    shared = list(range(1, 129))  # 4 pages a third request already finds on host
    plan = c.put(shared)
    assert c.put_done(plan) == 4
    # block 0 is vLLM's null block (a sliding window's freed one): never a request's here
    reqs = [(request("a", list(range(1000, 1100))), [1, 2, 3, 4]),  # 3 full pages, a partial one
            (request("b", list(range(5000, 5160))), [5, 6, 7, 8, 9]),  # 5 full pages
            (request("c", shared + [7]), [10, 11, 12, 13, 14])]  # 4 pages on host: nothing to save
    assert [admit(sched, r, blocks) for r, blocks in reqs] == [0, 0, 4 * PS]
    trips, puts = c.round_trips, c.calls["put"]
    meta = sched.build_meta(step(reqs))
    assert meta.saves == [] and c.calls["put"] == puts + 3  # sent, not waited for
    assert [sched.reqs[r].saved_pages for r in "abc"] == [3, 5, 4]
    saves = answered_saves(sched, IDLE)
    assert c.round_trips == trips  # no waited call on any step
    assert [(s.req_id, s.block_ids, len(s.host_pages)) for s in saves] == [
        ("a", [[1, 2, 3]], 3), ("b", [[5, 6, 7, 8, 9]], 5)]
    assert len({p for s in saves for p in s.host_pages}) == 8
    assert sched.has_pending_saves()
    # the workers report the copies done: the puts finish (posted with the next step's calls:
    # vLLM steps once more for them) and the pages are on host
    sched.on_output(HiCacheWorkerMeta(saved={s.put_id: True for s in saves}))
    assert sched.has_pending_saves()
    sched.build_meta(IDLE)
    assert not sched.has_pending_saves()
    assert c.match(list(range(5000, 5160))).host_len == 5


def test_a_block_aligned_prompt_loads_every_page_and_computes_its_last_token(sched):
    c = sched.clients[0]
    tokens = list(range(1, 4 * PS + 1))  # exactly 4 pages
    assert c.put_done(c.put(tokens)) == 4
    req = request("r", tokens)
    assert ask(sched, req) == 4 * PS - 1  # every page; vLLM computes the last token again
    sched.after_alloc(req, ([1, 2, 3, 4],), 4 * PS - 1)
    meta = sched.build_meta(IDLE)
    assert [(s.req_id, s.block_ids, len(s.host_pages[0]), s.stale) for s in meta.loads] == [
        ("r", [[1, 2, 3, 4]], 4, False)]
    # vLLM's own cache holds the first page: the rest, still short of the last token
    other = request("o", tokens)
    assert ask(sched, other, local=PS) == 3 * PS - 1


def test_a_daemon_away_gives_misses_and_no_saves(sched, daemon):
    reqs = [(request("a", list(range(1000, 1100))), [1, 2, 3, 4]),
            (request("b", list(range(5000, 5160))), [5, 6, 7, 8, 9])]
    for r, blocks in reqs:
        admit(sched, r, blocks)
    daemon.stop()
    meta = sched.build_meta(step(reqs))
    assert meta.saves == [] and sched.clients[0].outages == 1 and not sched.has_pending_saves()
    assert ask(sched, request("c", list(range(9000, 9100)))) == 0


def test_a_stopped_daemon_costs_no_step_a_wait_nor_the_connection(sched, daemon):
    """SIGSTOP: lookups ask again until what they could save is spent, then miss; puts wait
    unanswered. After SIGCONT the same connection answers, the late pins are released and the
    late puts are planned: nothing was lost but time."""
    c = sched.clients[0]
    tokens = list(range(1, 4 * PS + 1))
    assert c.put_done(c.put(tokens)) == 4
    hasty = SchedulerSide(SHAPE, NUM_BLOCKS, daemon.socket)  # the defaults: waits at most what a hit saves
    h = hasty.clients[0]
    reqs = [(request("a", list(range(1000, 1100))), [1, 2, 3, 4])]
    admit(hasty, reqs[0][0], [1, 2, 3, 4])
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert ask(hasty, request("hit", tokens + [5])) == 0  # a hit, but its answer never came
        hasty.build_meta(step(reqs))  # the put of a's pages: sent
        assert not hasty.build_meta(IDLE).saves  # not answered
        assert time.monotonic() - t0 < 10.0  # hang guard only: each ask returned at once
        assert hasty.lookups.given_up == 1 and h.connected and h.outages == 0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    saves = answered_saves(hasty, IDLE)
    assert [(s.req_id, s.block_ids) for s in saves] == [("a", [[1, 2, 3]])]
    hasty.on_output(HiCacheWorkerMeta(saved={s.put_id: True for s in saves}))
    assert h.connected and h.outages == 0 and h.epoch == 1
    wait_until(lambda: h.poll() and h.stats()["pins"] == 0, 30, "the late match's pin released")
    hasty.close()
    assert ask(sched, request("hit2", tokens + [5])) == 4 * PS
    assert c.match(list(range(1000, 1100))).host_len == 3  # the late put was planned, copied, finished


def test_a_finished_request_keeps_its_blocks_until_its_puts_are_answered_and_copied(sched):
    req = request("a", list(range(1000, 1100)))
    admit(sched, req, [1, 2, 3, 4])
    meta = sched.build_meta(step([(req, [1, 2, 3, 4])]))
    assert sched.request_finished(req)  # its put is out: vLLM keeps the blocks
    assert meta.delayed == []
    metas = []
    wait_until(lambda: metas.append(sched.build_meta(IDLE)) or metas[-1].saves, 30, "the put's answer")
    assert metas[-1].delayed == ["a"]  # announced with its copy plan
    sched.on_output(HiCacheWorkerMeta(saved={s.put_id: True for s in metas[-1].saves}))
    assert "a" not in sched.reqs
    sched.build_meta(IDLE)  # the step vLLM takes for the finished puts' reports
    assert not sched.has_pending_saves()


def test_a_preempted_requests_puts_in_flight_are_given_back(sched):
    c = sched.clients[0]
    req = request("a", list(range(1000, 1100)))
    admit(sched, req, [1, 2, 3, 4])
    sched.build_meta(step([(req, [1, 2, 3, 4])]))
    preempted = step([])
    preempted.preempted_req_ids = {"a"}
    meta = sched.build_meta(preempted)
    assert meta.preempted and meta.saves == [] and sched.reqs["a"].saved_pages == 0
    wait_until(lambda: c.poll() and c.stats()["puts"]["pending"] == 0, 30, "the dropped put given back")
    assert not sched.has_pending_saves()
