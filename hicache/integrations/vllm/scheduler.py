"""The scheduler side of the vLLM connector: every call to the daemon happens here, and
none of them is waited for on vLLM's step.

vLLM keeps its own prefix cache of device blocks; hicache is the tier below. For a new
request the scheduler matches the request's full pages in every namespace rank, asking
vLLM to ask again until the answers are in (lookups.py), and offers the pages beyond
vLLM's local hit that *every* rank holds on host (the match pins them: they cannot be
evicted before the workers copy them in). Each step it reserves host pages for the
full blocks the step computed (saves.py) and sends the workers the copy plans of the
reservations answered since; the workers' report finishes the puts. A finished request
whose copies are still running keeps its blocks until the workers say they are done.

Every call is sent without waiting: lookups and reservations are answered on a later
step, releases and finished puts are posted. A slow daemon costs requests their hits
(a lookup waits no longer than its answer could save) and pages their saves, never the
step a round trip, nor the connection (hicache/client/connection.py). A daemon away,
restarting or hung costs nothing: the client's breaker answers misses and skips stores
at once while it reconnects.

Hybrid models (several KV cache groups): a request's blocks are kept per group, a page
is stored only when every group still holds its block, loads are asynchronous (vLLM
can take a failed load back only per request when block ids are per group), and puts
are waited for (saves.py says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hicache.client.asks import wait_for_answers
from hicache.client.client import HiCacheClient
from hicache.client.deadlines import CallDeadlines
from hicache.integrations.request_keys import RequestKeys
from hicache.integrations.vllm.layout import EngineShape
from hicache.integrations.vllm.lookups import Lookup, Lookups, StepRate
from hicache.integrations.vllm.metadata import HiCacheMeta, HiCacheWorkerMeta, LoadSpec
from hicache.integrations.vllm.requests import RequestState, request_extras, request_hint
from hicache.integrations.vllm.saves import PutAsk, Saves

if TYPE_CHECKING:
    from hicache.integrations.vllm.events import KVEventBridge

log = logging.getLogger(__name__)

FLUSH_ASKS = 8  # lookups sent in one write when a step starts many (a burst of requests)
# A step that scheduled nothing while answers are awaited waits for one (returning as soon as it
# comes) rather than let vLLM spin through empty steps: each empty step is a round of the workers
# too, and with tensor parallelism on a small host those rounds spin every core and starve the
# daemon whose answer they wait for (two TP workers on 2 cores froze the machine 15 s). The wait
# doubles while nothing comes, from IDLE_WAIT_MIN_S to IDLE_WAIT_MAX_S: a request arriving then
# waits at most that much longer for its first step.
IDLE_WAIT_MIN_S = 0.001
IDLE_WAIT_MAX_S = 0.05


class SchedulerSide:
    def __init__(self, shape: EngineShape, num_blocks: int, socket_path: str | None, *,
                 lease_s: float = 30.0, deadlines: CallDeadlines | None = None,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.shape = shape
        self.page_size = shape.layout.page_size
        self.load_async = shape.is_hybrid
        self.lease_s = lease_s
        ranks = 1 if shape.is_mla else shape.tp_size
        self.clients: dict[int, HiCacheClient] = {}
        for r in range(ranks):
            tp_rank, tp_size = shape.namespace_rank(r)
            c = HiCacheClient(shape.layout, num_blocks, model=shape.model, socket_path=socket_path,
                              tp_rank=tp_rank, tp_size=tp_size, extra_key=shape.extra_key(),
                              deadlines=deadlines, prefill_tokens_per_s=prefill_tokens_per_s)
            c.map_arena = False  # the workers copy; this side only needs the slab versions
            c.corked = True  # a step's calls leave in one write, at the end of build_meta
            self.clients[r] = c
        for c in self.clients.values():
            c.connect()  # each step bounded by its deadline; if down, the probe keeps trying
        self.rate = StepRate(prefill_tokens_per_s)
        self.lookups = Lookups(self.clients, self.page_size, self.rate)
        self.saves = Saves(self.clients, self.page_size, wait=shape.is_hybrid)
        self.reqs: dict[str, RequestState] = {}
        self.loads_next: list[tuple[str, int, int]] = []  # (request, pages [start, end)) for the next metadata
        self.finishing: dict[str, RequestState] = {}  # finished requests kept for their saves
        self._polled = False  # this step's answers were read (once a step: a recv per client)
        self._asked = 0  # lookups started this step
        self._idle_wait_s = IDLE_WAIT_MIN_S  # an empty step's wait for an answer (doubles while none comes)
        self._expiry_check = 0.0  # when to look for pins held past lease_s next
        self._events: KVEventBridge | None = None  # set by the connector when vLLM publishes KV events

    @property
    def events(self) -> KVEventBridge | None:
        return self._events

    @events.setter
    def events(self, bridge: KVEventBridge | None) -> None:
        self._events = self.saves.events = bridge

    @property
    def null_block(self) -> int:
        return self.saves.null_block

    @null_block.setter
    def null_block(self, block_id: int) -> None:
        """vLLM's placeholder block id (the connector's bind_gpu_block_pool sets it)."""
        self.saves.null_block = block_id

    # -- requests -------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState | None:
        st = self.reqs.get(request.request_id)
        if st is None:
            ex = request_extras(request)
            if ex is None:
                return None
            keys = {r: RequestKeys(c.salt, self.page_size, extras=ex[0], items=ex[1])
                    for r, c in self.clients.items()}
            st = self.reqs[request.request_id] = RequestState(request, keys, hint=request_hint(request))
        return st

    def _pin_prompt(self, st: RequestState) -> None:
        """The request finished and its saves are reported: pin (or prioritize) its prompt's
        stored pages as its hint asks. Posted after the puts' put_done, which the daemon
        handles first."""
        if st.hint is None:
            return
        tokens = st.request.all_token_ids
        prompt = getattr(st.request, "num_prompt_tokens", len(tokens))
        n = min(st.saved_pages, prompt // self.page_size)
        if n <= 0:
            return
        for r, c in self.clients.items():
            c.retain(st.hint, keys=st.keys[r].upto(tokens, n), wait=False)

    def _release(self, st: RequestState) -> None:
        if st.lookup is not None:
            self.lookups.release(st.lookup)
            st.lookup = None
        st.load = None

    def _poll(self) -> None:
        for c in self.clients.values():
            c.poll()
        self._polled = True

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's local hit that every rank holds on host (0 on any doubt);
        None: ask again (the answers are not in yet)."""
        st = self._state(request)
        if st is None or st.load_failed:
            return 0, False
        tokens = request.all_token_ids
        n_pages = len(tokens) // self.page_size
        local = num_computed_tokens // self.page_size
        if n_pages <= local:
            self._release(st)
            return 0, False
        lk = st.lookup
        if lk is not None and lk.miss:  # asked again (no room this step): the same answer
            return 0, False
        if lk is None or (not lk.asks and not lk.matches):
            lk = st.lookup = self.lookups.start({r: st.keys[r].upto(tokens, n_pages) for r in self.clients},
                                                n_pages, local)
            st.pinned_at = lk.started
            self._asked += 1
            if self._asked % FLUSH_ASKS == 0:  # a burst of new requests: the daemon starts on them now
                for c in self.clients.values():
                    c.flush()
            return None, False
        if lk.asks:
            if not self._polled:
                self._poll()
            if not self.lookups.advance(lk, local):
                return None, False
            if self.events is not None and not lk.miss:
                for r, m in lk.matches.items():
                    self.events.note_match(r, request, m.keys, m.host_len)
        offered, start, end = self.lookups.offer(lk, len(tokens), local)
        if not offered:
            self._release(st)
            st.lookup = Lookup(lk.started, n_pages, miss=True)  # kept until vLLM schedules it
            return 0, False
        st.load = (start, end)
        return offered, self.load_async

    def after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (per KV cache group) and counts on
        `num_external_tokens` from us."""
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        st.blocks = [list(b) for b in block_ids]
        if num_external_tokens <= 0 or st.load is None:
            self._release(st)
            return
        start, end = st.load
        offered = min(end * self.page_size, len(request.all_token_ids) - 1) - start * self.page_size
        if offered != num_external_tokens or any(len(b) < end for b in st.blocks):
            # vLLM counts these tokens as computed: a stale load makes it recompute them
            log.warning("request %s: vLLM took %d external tokens of the %d offered; recomputing them",
                        request.request_id, num_external_tokens, offered)
            self._release(st)
            end = start + -(-num_external_tokens // self.page_size)
        self.loads_next.append((request.request_id, start, end))

    # -- each step ------------------------------------------------------------------------
    def build_meta(self, so: Any) -> HiCacheMeta:
        meta = HiCacheMeta(preempted=bool(getattr(so, "preempted_req_ids", None)))
        scheduled = getattr(so, "total_num_scheduled_tokens", None)  # None: an output without the count
        self.rate.step(int(scheduled or 0))
        self._poll()
        self._track_blocks(so)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.saves.plan(meta)  # the puts answered since the last step
        asks: list[PutAsk] = []
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is not None:
                ask = self.saves.ask(st, computed.get(req_id, 0) + n_sched)
                if ask is not None:
                    asks.append(ask)
        self.saves.send(asks)
        self.saves.plan(meta)  # waited puts (hybrid models), and those that could not be sent
        # Last, after every call of this step: a client that reconnected meanwhile (a new daemon,
        # a new arena) made the page ids of its earlier matches and puts meaningless.
        meta.instances = {r: c.instance for r, c in self.clients.items()}
        meta.slabs = {r: c.slab_version for r, c in self.clients.items()}
        self.saves.void_stale(meta)
        meta.loads = [self._load_spec(*load) for load in self.loads_next if load[0] in self.reqs]
        self.loads_next = []
        meta.delayed = self._announce_finished()
        self._expire_pins()
        for c in self.clients.values():  # the step's lookups, puts and reports: one write
            c.flush()
        if scheduled != 0:  # the step computes (or does not say): nothing to wait for
            self._idle_wait_s = IDLE_WAIT_MIN_S
        elif wait_for_answers(self.clients.values(), self._idle_wait_s):  # an answer came, or none is owed
            self._idle_wait_s = IDLE_WAIT_MIN_S
        else:
            self._idle_wait_s = min(self._idle_wait_s * 2, IDLE_WAIT_MAX_S)
        self._polled = False
        self._asked = 0
        return meta

    def _load_spec(self, req_id: str, start: int, end: int) -> LoadSpec:
        """The copies vLLM now counts on; stale (the workers report its blocks failed, vLLM
        recomputes them) when the pins are gone or predate a reconnect."""
        st = self.reqs[req_id]
        blocks = [b[start:end] for b in st.blocks]
        if self.shape.is_hybrid:  # a block a sliding window skipped is not needed: -1 tells the workers
            blocks = [[-1 if i == self.null_block else i for i in b] for b in blocks]
        matches = st.lookup.matches if st.lookup is not None else {}
        if not matches or any(m.epoch != self.clients[r].epoch for r, m in matches.items()):
            return LoadSpec(req_id, blocks, {}, stale=True)
        return LoadSpec(req_id, blocks, {r: m.host_pages[start:end].tolist() for r, m in matches.items()})

    def _track_blocks(self, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.blocks = [list(b) for b in new.block_ids]
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            st = self.reqs.get(req_id)
            if st is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:  # after preemption: a new block list
                self.saves.drop(st)
                st.blocks = [list(b) for b in new_ids]
                st.saved_pages = 0
            else:
                for blocks, added in zip(st.blocks, new_ids):
                    blocks.extend(added)
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            st = self.reqs.get(req_id)
            if st is not None:  # its blocks are freed: what it asked to store is not in them
                self.saves.drop(st)
                st.saved_pages = 0

    def _announce_finished(self) -> list[str]:
        """Finished requests whose puts are all answered: the workers hold their blocks until
        the copies planned for them are done (at once when none are)."""
        out = []
        for req_id, st in self.finishing.items():
            if not st.announced and not st.asking:
                st.announced = True
                out.append(req_id)
        return out

    def _expire_pins(self) -> None:
        """Pins a load never reported (a worker that died, a request vLLM dropped) go after
        lease_s (looked for once a second: a step need not walk every request)."""
        now = time.monotonic()
        if now < self._expiry_check:
            return
        self._expiry_check = now + 1.0
        for st in self.reqs.values():
            lk = st.lookup
            if lk is not None and lk.matches and now - st.pinned_at > self.lease_s:
                log.warning("request %s: releasing pins held %.0f s", st.request.request_id, now - st.pinned_at)
                self._release(st)

    def on_output(self, worker_meta: Any, failed_loads: Iterable[str] = ()) -> None:
        """The workers' report: finish the puts whose copies ran, release the pins of loads done.
        A request whose async load failed is recomputed by vLLM, which asks us again: it gets 0."""
        for req_id in failed_loads:
            st = self.reqs.get(req_id)
            if st is not None:
                st.load_failed = True
        if isinstance(worker_meta, HiCacheWorkerMeta):
            for req_id in worker_meta.loaded:
                st = self.reqs.get(req_id)
                if st is not None:
                    self._release(st)
            if worker_meta.saved:
                self.saves.done(worker_meta.saved)
        for req_id in [r for r, st in self.finishing.items() if st.announced and not st.puts]:
            del self.finishing[req_id]
            self._pin_prompt(self.reqs.pop(req_id))

    def request_finished(self, request: Any) -> bool:
        """True: the blocks stay until the workers report the request's saves done."""
        st = self.reqs.get(request.request_id)
        if st is None:
            return False
        self._release(st)
        if st.puts or st.asking:
            st.finished = True
            self.finishing[request.request_id] = st
            return True
        self._pin_prompt(self.reqs.pop(request.request_id))
        return False

    def has_pending_saves(self) -> bool:
        """Puts not answered or whose copies are not reported, or reports not sent yet (the
        clients are corked until the next step's build_meta): vLLM keeps stepping so they
        get finished."""
        return self.saves.pending() or any(c.unsent for c in self.clients.values())

    def stats(self) -> dict[str, Any]:
        return {**self.lookups.stats(), "late": sum(c.late for c in self.clients.values()),
                "outages": sum(c.outages for c in self.clients.values())}

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        for st in self.reqs.values():
            self._release(st)
        self.saves.close()
        for c in self.clients.values():
            c.flush()
            c.close()
