"""The scheduler side of the vLLM connector: every call to the daemon happens here.

vLLM keeps its own prefix cache of device blocks; hicache is the tier below.
For a new request the scheduler matches the request's full pages in every
namespace rank and offers vLLM the pages beyond its local hit that *every*
rank holds on host (the match pins them: they cannot be evicted before the
workers copy them in). When a disk part is being brought up it answers "ask
again" for at most `disk_wait_s`, holding the pins so the prefetch is kept.

Each step it reserves host pages (a put, hicache/daemon/ingest/puts.py) for the full
blocks the step computes (every request's put in one pipelined round trip per rank),
sends the workers the copy plans, and on their report (worker metadata) finishes
the puts. A finished request whose copies are still
running keeps its blocks until the workers say they are done.

The daemon away, restarting or hung costs one deadline then nothing: the client's
circuit breaker answers misses and skips stores at once while it reconnects.
Releases and finished puts are sent without waiting for their answers (the
client's `wait=False`): the step waits only for lookups (`match`, `load`, one per
request: vLLM asks per request) and for its reservations (`put`, one per step),
and a daemon slow to answer a call nobody needs cannot drop the connection.

Hybrid models (several KV cache groups): a request's blocks are kept per group,
and a page is stored only when every group still holds its block (vLLM frees
sliding-window blocks behind the window: such pages are not saved). Loads are
asynchronous there (the request waits for its KV), because vLLM can take a
failed load back only per request when block ids are per group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.client.client import HiCacheClient, Match, PutPlan
from hicache.client.hints import RetainHint
from hicache.client.deadlines import CallDeadlines
from hicache.integrations.request_keys import RequestKeys
from hicache.integrations.vllm.layout import EngineShape
from hicache.integrations.vllm.metadata import HiCacheMeta, HiCacheWorkerMeta, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from hicache.integrations.vllm.events import KVEventBridge

log = logging.getLogger(__name__)

SAVE_RETRIES = 8  # steps a hybrid request's save may wait for an earlier put of its prefix


@dataclass(slots=True, eq=False)
class _Req:
    request: Any  # vllm Request: all_token_ids grows as it decodes
    keys: dict[int, RequestKeys]  # per namespace rank (salts differ)
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_pages: int = 0  # leading pages stored (or being stored)
    save_retries: int = 0  # steps a save waited for the pages before a window-freed block to be stored
    matches: dict[int, Match] = field(default_factory=dict)  # pins of the pending or running load
    pinned_at: float = 0.0
    disk_deadline: float | None = None
    load: tuple[int, int] | None = None  # pages [start, end) the workers load this step
    puts: dict[int, tuple[int, PutPlan]] = field(default_factory=dict)  # put id -> (rank, plan), not reported
    finished: bool = False  # vLLM finished it; kept while its saves run
    load_failed: bool = False  # an async load failed: vLLM recomputes it, we offer it nothing more
    hint: RetainHint | None = None  # kv_transfer_params {"hicache": {...}}: pin or prioritize the prompt once stored


@dataclass(slots=True, eq=False)
class _SaveAsk:
    """A request's pages to reserve this step: [0, full) of its tokens, keyed per rank."""

    req_id: str
    st: _Req
    full: int
    stored: Sequence[int]  # the tokens of those pages
    keys: dict[int, list[bytes]]


def request_extras(request: Any) -> tuple[list[str], list[tuple[str, int, int]]] | None:
    """What the request's KV depends on besides its token ids (see request_keys.py);
    None when it cannot be keyed at all (prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    extras = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora={lora.lora_name}/{getattr(lora, 'lora_int_id', '')}/{getattr(lora, 'lora_path', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(f"cache_salt={salt}")
    items = [(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
             for f in (getattr(request, "mm_features", None) or [])]
    return extras, items


def request_hint(request: Any) -> RetainHint | None:
    """The retention hint a request carries in kv_transfer_params (vLLM fills them from
    SamplingParams.extra_args["kv_transfer_params"]); a malformed one is logged and
    ignored: a cache hint never fails a request."""
    try:
        return RetainHint.from_transfer_params(getattr(request, "kv_transfer_params", None))
    except ValueError as e:
        log.warning("request %s: hicache hint ignored: %s", getattr(request, "request_id", "?"), e)
        return None


class SchedulerSide:
    def __init__(self, shape: EngineShape, num_blocks: int, socket_path: str | None, *,
                 lease_s: float = 30.0, disk_wait_s: float = 0.5, deadlines: CallDeadlines | None = None,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.shape = shape
        self.page_size = shape.layout.page_size
        self.load_async = shape.is_hybrid
        self.null_block = 0  # vLLM's placeholder block id (the connector's bind_gpu_block_pool sets it)
        self.lease_s = lease_s
        self.disk_wait_s = disk_wait_s
        ranks = 1 if shape.is_mla else shape.tp_size
        self.clients: dict[int, HiCacheClient] = {}
        for r in range(ranks):
            tp_rank, tp_size = shape.namespace_rank(r)
            self.clients[r] = HiCacheClient(shape.layout, num_blocks, model=shape.model, socket_path=socket_path,
                                            tp_rank=tp_rank, tp_size=tp_size, extra_key=shape.extra_key(),
                                            deadlines=deadlines, prefill_tokens_per_s=prefill_tokens_per_s)
        for c in self.clients.values():
            c.connect()  # each step bounded by its deadline; if down, the probe keeps trying
        self.reqs: dict[str, _Req] = {}
        self.loads_next: list[tuple[str, int, int]] = []  # (request, pages [start, end)) for the next metadata
        self.delayed: list[str] = []  # finished requests keeping their blocks for running saves
        self.events: KVEventBridge | None = None  # set by the connector when vLLM publishes KV events

    # -- requests -------------------------------------------------------------------------
    def _state(self, request: Any) -> _Req | None:
        st = self.reqs.get(request.request_id)
        if st is None:
            ex = request_extras(request)
            if ex is None:
                return None
            keys = {r: RequestKeys(c.salt, self.page_size, extras=ex[0], items=ex[1])
                    for r, c in self.clients.items()}
            st = self.reqs[request.request_id] = _Req(request, keys, hint=request_hint(request))
        return st

    def _pin_prompt(self, st: _Req) -> None:
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

    def _release(self, st: _Req) -> None:
        for r, m in st.matches.items():
            self.clients[r].release(m, wait=False)
        st.matches = {}
        st.load = None

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's local hit that every rank holds on host (0 on any doubt)."""
        st = self._state(request)
        if st is None or st.load_failed:
            return 0, False
        tokens = request.all_token_ids
        n_pages = (len(tokens) - 1) // self.page_size  # vLLM computes at least the last token
        local = num_computed_tokens // self.page_size
        if n_pages <= local:
            self._release(st)
            return 0, False
        now = time.monotonic()
        if st.matches and st.disk_deadline is not None:  # asked again while the disk part comes up
            for r, m in st.matches.items():
                if m.disk_len:
                    self.clients[r].refresh(m)
        else:
            self._release(st)
            st.matches = {r: c.match(keys=st.keys[r].upto(tokens, n_pages)) for r, c in self.clients.items()}
            st.pinned_at = now
        ms = st.matches.values()
        if any(m.pin is None or m.device_len for m in ms):  # daemon away (or a device part we cannot use)
            self._release(st)
            return 0, False
        if self.events is not None:
            for r, m in st.matches.items():
                self.events.note_match(r, request, m.keys, m.host_len)
        if any(m.disk_len for m in ms):
            if st.disk_deadline is None:
                st.disk_deadline = now + self.disk_wait_s
            if now < st.disk_deadline:
                return None, False  # vLLM asks again next step; the pins keep the prefetch
        st.disk_deadline = None
        hit = min(m.host_len for m in ms)
        if hit <= local:
            self._release(st)
            return 0, False
        st.load = (local, hit)
        return (hit - local) * self.page_size, self.load_async

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
        if (end - start) * self.page_size != num_external_tokens or any(len(b) < end for b in st.blocks):
            # vLLM counts these tokens as computed: a stale load makes it recompute them
            log.warning("request %s: vLLM took %d external tokens of the %d offered; recomputing them",
                        request.request_id, num_external_tokens, (end - start) * self.page_size)
            self._release(st)
            end = start + -(-num_external_tokens // self.page_size)
        self.loads_next.append((request.request_id, start, end))

    # -- each step ------------------------------------------------------------------------
    def build_meta(self, so: Any) -> HiCacheMeta:
        meta = HiCacheMeta(preempted=bool(getattr(so, "preempted_req_ids", None)))
        self._track_blocks(so)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        asks = []
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is not None:
                ask = self._save_ask(req_id, st, computed.get(req_id, 0) + n_sched)
                if ask is not None:
                    asks.append(ask)
        self._plan_saves(asks, meta)
        # Last, after every call of this step: a client that reconnected meanwhile (a new daemon,
        # a new arena) made the page ids of its earlier matches and puts meaningless.
        meta.instances = {r: c.instance for r, c in self.clients.items()}
        meta.slabs = {r: c.slab_version for r, c in self.clients.items()}
        meta.saves = [s for s in meta.saves if self._current_put(s)]
        meta.loads = [self._load_spec(*load) for load in self.loads_next if load[0] in self.reqs]
        self.loads_next = []
        meta.delayed, self.delayed = self.delayed, []
        self._expire_pins()
        return meta

    def _load_spec(self, req_id: str, start: int, end: int) -> LoadSpec:
        """The copies vLLM now counts on; stale (the workers report its blocks failed, vLLM
        recomputes them) when the pins are gone or predate a reconnect."""
        st = self.reqs[req_id]
        blocks = [b[start:end] for b in st.blocks]
        if self.shape.is_hybrid:  # a block a sliding window skipped is not needed: -1 tells the workers
            blocks = [[-1 if i == self.null_block else i for i in b] for b in blocks]
        if not st.matches or any(m.epoch != self.clients[r].epoch for r, m in st.matches.items()):
            return LoadSpec(req_id, blocks, {}, stale=True)
        return LoadSpec(req_id, blocks, {r: m.host_pages[start:end].tolist() for r, m in st.matches.items()})

    def _current_put(self, s: SaveSpec) -> bool:
        st = self.reqs[s.req_id]
        rank, plan = st.puts[s.put_id]
        if plan.epoch == self.clients[rank].epoch:
            return True
        del st.puts[s.put_id]  # its daemon is gone, and the put with it
        return False

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
                st.blocks = [list(b) for b in new_ids]
                st.saved_pages = 0
            else:
                for blocks, added in zip(st.blocks, new_ids):
                    blocks.extend(added)

    def _save_ask(self, req_id: str, st: _Req, computed_after: int) -> _SaveAsk | None:
        """The full blocks this step completes beyond those stored, if any."""
        tokens = st.request.all_token_ids
        held = min((len(b) for b in st.blocks), default=0)
        full = min(computed_after, len(tokens), held * self.page_size) // self.page_size
        if full <= st.saved_pages:
            return None
        return _SaveAsk(req_id, st, full, tokens[:full * self.page_size],
                        {r: st.keys[r].upto(tokens, full) for r in self.clients})

    def _plan_saves(self, asks: list[_SaveAsk], meta: HiCacheMeta) -> None:
        """Reserve host pages for the step's full blocks: per rank, every request's put in one
        pipelined round trip (the daemon handles them in order, as if sent one by one)."""
        if not asks:
            return
        plans = {r: c.put_many([(a.stored, a.keys[r]) for a in asks]) for r, c in self.clients.items()}
        for i, ask in enumerate(asks):
            st = ask.st
            retry = False
            for r, c in self.clients.items():
                plan = plans[r][i]
                if plan is not None and self.events is not None:
                    self.events.note_put(r, st.request, ask.keys[r], plan.present, start=st.saved_pages)
                if plan is None or plan.put is None:
                    continue
                blocks = [b[plan.present:ask.full] for b in st.blocks]
                if any(self.null_block in b for b in blocks):
                    # A sliding window freed a block of a page the host lacks: no whole page to store.
                    # Typically the pages before it are still in another request's put: ask again
                    # for a few steps, when they may be stored and the put starts past the freed blocks.
                    c.put_done(plan, False, wait=False)
                    retry = st.save_retries < SAVE_RETRIES
                    continue
                meta.saves.append(SaveSpec(ask.req_id, r, plan.put, blocks, plan.host_pages.tolist()))
                st.puts[plan.put] = (r, plan)
            if retry:
                st.save_retries += 1
                continue
            st.saved_pages = ask.full

    def _expire_pins(self) -> None:
        """Pins a load never reported (a worker that died, a request vLLM dropped) go after lease_s."""
        now = time.monotonic()
        for st in self.reqs.values():
            if st.matches and now - st.pinned_at > self.lease_s:
                log.warning("request %s: releasing pins held %.0f s", st.request.request_id, now - st.pinned_at)
                self._release(st)

    def on_output(self, worker_meta: Any, failed_loads: Iterable[str] = ()) -> None:
        """The workers' report: finish the puts whose copies ran, release the pins of loads done.
        A request whose async load failed is recomputed by vLLM, which asks us again: it gets 0."""
        for req_id in failed_loads:
            st = self.reqs.get(req_id)
            if st is not None:
                st.load_failed = True
        if not isinstance(worker_meta, HiCacheWorkerMeta):
            return
        for req_id in worker_meta.loaded:
            st = self.reqs.get(req_id)
            if st is not None:
                self._release(st)
        if not worker_meta.saved:
            return
        by_put = {pid: (st, rank, plan) for st in self.reqs.values() for pid, (rank, plan) in st.puts.items()}
        for put_id, ok in worker_meta.saved.items():
            found = by_put.get(put_id)
            if found is None:
                continue
            st, rank, plan = found
            del st.puts[put_id]
            self.clients[rank].put_done(plan, ok, wait=False)
        for req_id in [r for r, st in self.reqs.items() if st.finished and not st.puts]:
            self._pin_prompt(self.reqs.pop(req_id))

    def request_finished(self, request: Any) -> bool:
        """True: the blocks stay until the workers report the request's saves done."""
        st = self.reqs.get(request.request_id)
        if st is None:
            return False
        self._release(st)
        if st.puts:
            st.finished = True
            self.delayed.append(request.request_id)
            return True
        self._pin_prompt(self.reqs.pop(request.request_id))
        return False

    def has_pending_saves(self) -> bool:
        """Puts whose copies are not reported yet: vLLM keeps stepping so they get finished."""
        return any(st.puts for st in self.reqs.values())

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        for st in self.reqs.values():
            self._release(st)
        for c in self.clients.values():
            c.close()
