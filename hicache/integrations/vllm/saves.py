"""The scheduler's saves: host pages reserved for the blocks each step completes, without
waiting for the daemon on the step.

Each step, the full blocks a request completes beyond those already stored are offered
(`put`, one per request and namespace rank, all of a step in one write). The answers
are read on a later step (they have always come by then, unless the daemon is slow)
and become the workers' copy plans (SaveSpec) of that step's metadata; the workers
report the copies done, and `put_done` (posted) makes the pages visible. A request's
blocks stay valid while it runs, so a plan a step late copies the same KV; a request
vLLM preempts (its blocks freed) loses its puts in flight (given back when answered),
and one that finishes keeps its blocks until every put it asked for is answered and
copied (`request_finished` returns True; `ready_to_free`).

Hybrid models (sliding-window groups) are the exception: vLLM frees blocks behind the
window at the start of the next step's scheduling, before a late plan could copy them,
so their puts are waited for on the step that completes the blocks (`wait=True`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.client.asks import PENDING, Ask
from hicache.client.client import HiCacheClient, PutPlan
from hicache.integrations.vllm.metadata import HiCacheMeta, SaveSpec
from hicache.integrations.vllm.requests import RequestState

if TYPE_CHECKING:
    from hicache.integrations.vllm.events import KVEventBridge

log = logging.getLogger(__name__)

SAVE_RETRIES = 8  # steps a hybrid request's save may wait for an earlier put of its prefix


@dataclass(slots=True, eq=False)
class PutAsk:
    """A request's pages [0, full) offered this step, keyed per rank; `asks` the puts in
    flight per rank (None: waited for, the answers in `plans`)."""

    st: RequestState
    full: int
    start: int  # pages before it were offered by earlier puts of the request
    keys: dict[int, list[bytes]]
    asks: dict[int, Ask] | None = None
    plans: dict[int, PutPlan | None] | None = None


class Saves:
    def __init__(self, clients: Mapping[int, HiCacheClient], page_size: int, *, wait: bool,
                 null_block: int = 0) -> None:
        self.clients = clients
        self.page_size = page_size
        self.wait = wait
        self.null_block = null_block
        self.events: KVEventBridge | None = None
        self.asking: list[PutAsk] = []  # puts in flight, in the order sent
        self.by_put: dict[int, tuple[RequestState, int, PutPlan]] = {}  # put id -> (request, rank, plan) being copied

    def ask(self, st: RequestState, computed_after: int) -> PutAsk | None:
        """The full blocks this step completes beyond those offered, if any."""
        if computed_after // self.page_size <= st.saved_pages:  # most decode steps: no block completed
            return None
        tokens = st.request.all_token_ids
        held = min(map(len, st.blocks)) if st.blocks else 0
        full = min(computed_after, len(tokens), held * self.page_size) // self.page_size
        if full <= st.saved_pages:
            return None
        return PutAsk(st, full, st.saved_pages, {r: st.keys[r].upto(tokens, full) for r in self.clients})

    def send(self, asks: list[PutAsk]) -> None:
        """Offer the step's pages: per rank, every request's put in one write."""
        if not asks:
            return
        # the pages' tokens, packed once as the keys were hashed (the same on every rank)
        stored = [a.st.keys[next(iter(a.keys))].token_bytes[:a.full * self.page_size * 4] for a in asks]
        if self.wait:
            plans = {r: c.put_many([(s, a.keys[r]) for s, a in zip(stored, asks)]) for r, c in self.clients.items()}
            for i, a in enumerate(asks):
                a.plans = {r: plans[r][i] for r in self.clients}
        else:
            sent = {r: c.ask_puts([(s, a.keys[r]) for s, a in zip(stored, asks)]) for r, c in self.clients.items()}
            for i, a in enumerate(asks):
                a.asks = {r: sent[r][i] for r in self.clients}
        for a in asks:
            a.st.saved_pages = a.full
            a.st.asking += 1
        self.asking += asks

    def plan(self, meta: HiCacheMeta) -> None:
        """The answered puts become this step's copy plans, in the order they were sent."""
        still = []
        for a in self.asking:
            if a.plans is None:
                assert a.asks is not None
                answers = {r: self.clients[r].answer(x) for r, x in a.asks.items()}
                if any(x is PENDING for x in answers.values()):
                    still.append(a)
                    continue
                a.plans = answers
            a.st.asking -= 1
            self._plan_one(a, a.plans, meta)
        self.asking = still

    def _plan_one(self, a: PutAsk, plans: dict[int, PutPlan | None], meta: HiCacheMeta) -> None:
        st = a.st
        retry = False
        for r, plan in plans.items():
            c = self.clients[r]
            if plan is not None and self.events is not None:
                self.events.note_put(r, st.request, a.keys[r], plan.present, start=a.start)
            if plan is None or plan.put is None:
                continue
            blocks = [b[plan.present:a.full] for b in st.blocks]
            if any(self.null_block in b for b in blocks):
                # A sliding window freed a block of a page the host lacks: no whole page to store.
                # Typically the pages before it are still in another request's put: ask again
                # for a few steps, when they may be stored and the put starts past the freed blocks.
                c.put_done(plan, False, wait=False)
                retry = st.save_retries < SAVE_RETRIES
                continue
            meta.saves.append(SaveSpec(st.request.request_id, r, plan.put, blocks, plan.host_pages.tolist()))
            st.puts += 1
            self.by_put[plan.put] = (st, r, plan)
        if retry and st.saved_pages == a.full:
            st.save_retries += 1
            st.saved_pages = a.start

    def drop(self, st: RequestState) -> None:
        """The request's blocks are gone (preempted): its puts in flight copy nothing (what
        they reserve is given back when they are answered)."""
        for a in self.asking:
            if a.st is st and a.asks is not None:
                for r, x in a.asks.items():
                    self.clients[r].drop(x)
                a.asks, a.plans = None, {}

    def void_stale(self, meta: HiCacheMeta) -> None:
        """Plans of a daemon the client has since reconnected to are void (its put is gone)."""
        keep = []
        for s in meta.saves:
            st, rank, plan = self.by_put[s.put_id]
            if plan.epoch == self.clients[rank].epoch:
                keep.append(s)
            else:
                del self.by_put[s.put_id]
                st.puts -= 1
        meta.saves = keep

    def done(self, saved: Mapping[int, bool]) -> None:
        """The workers' report: finish the puts whose copies ran (posted, one write per rank)."""
        done: dict[int, list[tuple[PutPlan, bool]]] = {}
        for put_id, ok in saved.items():
            found = self.by_put.pop(put_id, None)
            if found is None:
                continue
            st, rank, plan = found
            st.puts -= 1
            done.setdefault(rank, []).append((plan, ok))
        for rank, items in done.items():
            self.clients[rank].put_dones(items)

    def pending(self) -> bool:
        return bool(self.asking or self.by_put)

    def close(self) -> None:
        for a in self.asking:
            for r, x in (a.asks or {}).items():
                self.clients[r].drop(x)
        self.asking = []

