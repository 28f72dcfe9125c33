"""The worker side of the vLLM connector: copies between vLLM's KV blocks and the arena.

The worker makes no cache decision and sends the daemon nothing but slab
mapping requests: the scheduler side matched, pinned and reserved, and the
metadata says which blocks go to or come from which host pages. One copy
thread runs the jobs in order (a load and a later save of the same blocks stay
ordered):

- loads, per layer: `start_load_kv` queues them before the forward pass, and
  `wait_for_layer_load(layer)` waits only for that layer, so attention of layer
  l runs while layers > l are still being copied;
- saves, all layers of the blocks a step completed: queued by `wait_for_save`
  after the forward pass and reported through the worker metadata when done,
  never waited for on the step's path (except for preempted requests, whose
  blocks vLLM frees at once).

A load that cannot run (the daemon restarted since the scheduler matched, a
slab that cannot be mapped, a copy error) reports its blocks through
`get_block_ids_with_load_errors`, and vLLM recomputes them.

On CUDA the copy thread is not used: the copies are queued layer by layer on
the worker's own load and save streams with events (../block_streams.py),
straight between vLLM's KV tensors and the registered arena.
`wait_for_layer_load` makes the step's stream wait on that layer's event, saves
wait on an event recorded on the step's stream after the forward pass, and a
copy is reported (loaded, saved, blocks freed) once its event has completed, as
seen when vLLM asks for the step's reports. Where the CPU path drains the copy thread before vLLM
reuses blocks (preemption, sliding windows), the step's stream waits for the
saves instead: the host does not.

Hybrid models (several KV cache groups): each layer copies the blocks of its own
group (a block a sliding window skipped, -1, is left alone); loads are
asynchronous, reported per request (finished, or failed: vLLM recomputes it);
and the saves of a step finish before the next step runs (`before_step`),
because vLLM frees sliding-window blocks behind the window without asking.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from hicache.client.client import HiCacheClient
from hicache.client.deadlines import CallDeadlines
from hicache.errors import LayoutError
from hicache.integrations.block_copy import BlockCopier, CopyMethod, arrangement
from hicache.integrations.block_streams import StreamApi, StreamCopies
from hicache.integrations.vllm.affinity import copy_thread_cpus, pin_this_thread
from hicache.integrations.vllm.layout import EngineShape, UnsupportedModel
from hicache.integrations.vllm.metadata import HiCacheMeta, HiCacheStats, HiCacheWorkerMeta, LoadSpec, SaveSpec

log = logging.getLogger(__name__)


class _Load:
    """One step's loads: an event per layer, set when that layer is in place (or failed);
    on CUDA a CUDA event per layer, recorded on the load stream after its copy."""

    def __init__(self, specs: list[LoadSpec], num_layers: int) -> None:
        self.specs = specs
        self.events = [threading.Event() for _ in range(num_layers)]
        self.cuda_events: list | None = None


def _needed(block_ids: list[int], host_pages: list[int]) -> tuple[list[int], list[int]]:
    """The blocks of a layer's group that are to be loaded (-1: skipped by its window), with their pages."""
    if min(block_ids, default=0) >= 0:
        return block_ids, host_pages
    pairs = [(b, h) for b, h in zip(block_ids, host_pages) if b >= 0]
    return [b for b, _ in pairs], [h for _, h in pairs]


class WorkerSide:
    """`stream_api`: the CUDA stream API the stream path uses (default torch.cuda; it runs
    for CUDA KV tensors, or for any when given: tests stand in a recorder on CPU);
    `copy_method`: BlockCopier's."""

    def __init__(self, shape: EngineShape, num_blocks: int, socket_path: str | None, tp_rank: int,
                 deadlines: CallDeadlines | None = None, *, stream_api: StreamApi | None = None,
                 copy_method: CopyMethod = "auto") -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.rank = 0 if shape.is_mla else tp_rank  # the namespace rank this worker copies in
        self.stores = shape.stores(tp_rank)
        ns_rank, ns_size = shape.namespace_rank(tp_rank)
        self.client = HiCacheClient(shape.layout, num_blocks, model=shape.model, socket_path=socket_path,
                                    tp_rank=ns_rank, tp_size=ns_size, extra_key=shape.extra_key(),
                                    deadlines=deadlines)
        self.client.on_reconnect.append(self._on_reconnect)
        self.layer_of: dict[str, int] = {}
        self.group_of_layer = shape.group_of_layer or (0,) * shape.layout.num_layers
        self.caches: list[torch.Tensor] = []
        self.copier: BlockCopier | None = None
        self.streams: StreamCopies | None = None  # CUDA: the copies' own streams
        self._stream_api = stream_api
        self._copy_method: CopyMethod = copy_method
        self.load: _Load | None = None
        self.stats = HiCacheStats()
        self._lock = threading.Lock()  # guards what the copy thread reports
        self._idle = threading.Condition(self._lock)
        self._queued = 0
        self._saving: dict[str, int] = {}  # request -> save jobs not finished
        self._saved: dict[int, bool] = {}  # put id -> ok, not reported yet
        self._loaded: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._recved: set[str] = set()  # async loads done (ok or not), not reported yet
        self._failed_reqs: set[str] = set()  # async loads that failed, not reported yet
        self._delayed: set[str] = set()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._copy_cpus = copy_thread_cpus()
        self._thread = threading.Thread(target=self._run, name="hicache-vllm-copy", daemon=True)
        self._thread.start()

    # -- set-up -----------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> None:
        """vLLM's per-layer KV tensors: check each has the arrangement the namespace names."""
        names = sorted(kv_caches, key=layer_index)
        if len(names) != self.shape.layout.num_layers:
            raise UnsupportedModel(f"{len(names)} KV tensors for {self.shape.layout.num_layers} attention layers")
        if self.shape.layer_names and tuple(names) != self.shape.layer_names:
            raise UnsupportedModel(f"KV tensors of layers {names}, the KV cache groups name {self.shape.layer_names}")
        for name in names:
            got = arrangement(kv_caches[name], self.num_blocks)
            if got != self.shape.arrangement:
                raise UnsupportedModel(f"layer {name}: KV tensor arranged {got}, hicache expected "
                                       f"{self.shape.arrangement} for this backend; pages would not be shared "
                                       "safely, so the connector refuses to run")
        self.layer_of = {name: i for i, name in enumerate(names)}
        self.caches = [kv_caches[n] for n in names]
        self.client.connect()
        if self.client.arena is not None and self.copier is None:
            self._make_copier()

    def _make_copier(self) -> None:
        assert self.client.arena is not None
        self.client.arena.prefault_cpus = self._copy_cpus  # its pre-faults off the forward pass's cores too
        self.copier = BlockCopier(self.caches, self.num_blocks, self.shape.layout, self.client.arena,
                                  method=self._copy_method)
        if self.copier.device.type == "cuda" or self._stream_api is not None:
            self.streams = StreamCopies(self.copier, self._stream_api)
        log.info("hicache: worker copies by %s%s", self.copier.method,
                 " on their own CUDA streams" if self.streams is not None else " on the copy thread")

    def _on_reconnect(self, epoch: int) -> None:
        """A (new) daemon: finish every copy from the old arena before the client drops it."""
        self.drain()
        assert self.client.arena is not None
        if self.caches:
            if self.copier is None:
                self._make_copier()
            else:
                self.client.arena.prefault_cpus = self._copy_cpus
                self.copier.rebind(self.client.arena)

    def _ready(self, meta: HiCacheMeta) -> bool:
        """Whether the host pages the scheduler planned are mapped here: same daemon, its
        namespace's slabs at the scheduler's version."""
        c = self.client
        want = meta.instances.get(self.rank)
        if c.instance != want:
            if c.connected:
                c.sync_slabs()  # nothing else tells us the daemon we know died: this call does
            c.connect()  # adopts the probe's connection, or tries now (each step bounded)
        if want is None or c.instance != want or self.copier is None:
            return False
        want = meta.slabs.get(self.rank)
        if want is not None and want > c.slab_version:  # the scheduler saw newer slabs in its answers
            c.sync_slabs()
        return True

    # -- loads ------------------------------------------------------------------------------
    def start_load(self, meta: HiCacheMeta) -> None:
        self.load = None
        stale = [s for s in meta.loads if s.stale]
        if stale:
            log.warning("hicache: %d loads lost their pages (daemon reconnected); vLLM recomputes", len(stale))
            self._fail_load(_Load(stale, self.shape.layout.num_layers))
        specs = [s for s in meta.loads if not s.stale and self.rank in s.host_pages]
        if not specs:
            return
        load = _Load(specs, self.shape.layout.num_layers)
        if not self.shape.is_hybrid:  # async loads: the forward pass does not wait for them
            self.load = load
        if not self._ready(meta):
            log.warning("hicache: %d loads cannot run here (daemon restarted or slabs unmapped); vLLM recomputes",
                        len(specs))
            self._fail_load(load)
            return
        if self.streams is not None:
            self._load_on_stream(load, self.streams)
            return
        self._submit(lambda: self._load_job(load))

    def _layer_ids(self, load: _Load) -> list[tuple[list[int], list[int]]]:
        """Per layer, the (blocks, host pages) of every request of the step: one copy per layer."""
        num_groups = max(self.group_of_layer) + 1
        blocks: list[list[int]] = [[] for _ in range(num_groups)]  # per KV cache group
        pages: list[list[int]] = [[] for _ in range(num_groups)]
        for s in load.specs:
            host = s.host_pages[self.rank]
            for g in range(num_groups):
                if len(s.block_ids[g]) != len(host):
                    raise LayoutError(f"request {s.req_id}: {len(s.block_ids[g])} blocks of group {g} "
                                      f"for {len(host)} host pages")
                b, h = _needed(s.block_ids[g], host)
                blocks[g] += b
                pages[g] += h
        return [(blocks[g], pages[g]) for g in self.group_of_layer]

    def _load_job(self, load: _Load) -> None:
        copier = self.copier
        assert copier is not None
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            per_layer = self._layer_ids(load)
            nbytes = sum(len(blocks) for blocks, _ in per_layer) * self.shape.layout.layer_page_bytes
            for layer, (blocks, pages) in enumerate(per_layer):
                copier.load_layer(layer, blocks, pages, transfer_bytes=nbytes)
                load.events[layer].set()
        except Exception:
            log.exception("hicache: loading KV failed; vLLM recomputes those blocks")
            self._fail_load(load)
            return
        cpu_s = time.thread_time() - cpu0  # read before the wall clock: within it
        self._load_done(load, True, time.perf_counter() - t0, cpu_s)

    def _load_on_stream(self, load: _Load, streams: StreamCopies) -> None:
        try:
            per_layer = self._layer_ids(load)
        except Exception:
            log.exception("hicache: loading KV failed; vLLM recomputes those blocks")
            self._fail_load(load)
            return
        load.cuda_events, error = streams.load(per_layer, lambda secs, err: self._load_done(load, err is None, secs))
        if error is not None:
            log.error("hicache: loading KV failed; vLLM recomputes those blocks", exc_info=error)
            # Said in this step, so vLLM recomputes before using them; the pins go (and a
            # hybrid request is reported) once what was queued has completed.
            self._fail_load(load, release=False)

    def _load_done(self, load: _Load, ok: bool, seconds: float, cpu_seconds: float = 0.0) -> None:
        """`seconds`: the copies' wall time; `cpu_seconds`: the copy thread's CPU time in it
        (the CPU path; the difference is time it waited for a core or the GIL)."""
        tokens = sum(len(s.block_ids[0]) for s in load.specs) * self.shape.layout.page_size
        with self._lock:
            self._loaded.update(s.req_id for s in load.specs)
            if self.shape.is_hybrid:
                self._recved.update(s.req_id for s in load.specs)
                if not ok:
                    self._failed_reqs.update(s.req_id for s in load.specs)
            d = self.stats.data
            if ok:
                d["loads"] += len(load.specs)
                d["loaded_tokens"] += tokens
            d["load_s"] += seconds
            d["load_cpu_s"] += cpu_seconds

    def _fail_load(self, load: _Load, release: bool = True) -> None:
        """Report the loads failed; `release`: and finished (False: `_load_done` will, and
        reports a hybrid model's requests failed then)."""
        with self._lock:
            for s in load.specs:
                if self.shape.is_hybrid:  # block ids are per group: vLLM takes a failure per request
                    if release:
                        self._failed_reqs.add(s.req_id)
                        self._recved.add(s.req_id)
                else:
                    self._failed_blocks.update(s.block_ids[0])
            if release:
                self._loaded.update(s.req_id for s in load.specs)
            self.stats.data["load_errors"] += sum(len(s.block_ids[0]) for s in load.specs)
        for ev in load.events:
            ev.set()

    def wait_for_layer(self, layer_name: str) -> None:
        load = self.load
        if load is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        if load.cuda_events is not None:
            assert self.streams is not None
            self.streams.wait_layer(load.cuda_events[layer])
        else:
            load.events[layer].wait()

    # -- saves ------------------------------------------------------------------------------
    def before_step(self, meta: HiCacheMeta) -> None:
        """Before the step touches any block: blocks vLLM freed since the last step (a preempted
        request's; hybrid: sliding-window blocks behind the window) may be reused now, so the
        saves still reading them must be done (on CUDA: ordered before the step's work)."""
        if meta.preempted or self.shape.is_hybrid:
            self._saves_before_reuse()

    def _saves_before_reuse(self) -> None:
        if self.streams is not None:
            self.streams.order_after_saves()
        else:
            self.drain()

    def start_saves(self, meta: HiCacheMeta) -> None:
        """After the forward pass: queue this step's saves; report them when done."""
        load, self.load = self.load, None
        if load is not None and load.cuda_events is None:  # every layer was waited for by the forward pass
            load.events[-1].wait()
        with self._lock:
            self._delayed.update(meta.delayed)
        specs = [s for s in meta.saves if s.rank == self.rank] if self.stores else []
        ready = bool(specs) and self._ready(meta)
        if not ready:
            with self._lock:
                self._saved.update((s.put_id, False) for s in specs)
            specs = []
        with self._lock:
            for s in specs:
                self._saving[s.req_id] = self._saving.get(s.req_id, 0) + 1
        if specs and self.streams is not None:
            # After the forward pass's writes (an event on the step's stream) and this step's
            # loads (a layer the model never waited for is still ordered before its save).
            after = [load.cuda_events[-1]] if load is not None and load.cuda_events else []
            self.streams.save([lambda s=s: self._save_copy(s) for s in specs], after,
                              lambda seconds, errors: self._saves_done(specs, errors, seconds))
        else:
            for s in specs:
                self._submit(lambda s=s: self._save_job(s))
        if meta.preempted:  # vLLM frees a preempted request's blocks now: the copies must be done
            self._saves_before_reuse()

    def _save_copy(self, s: SaveSpec) -> None:
        copier = self.copier
        assert copier is not None
        if self.shape.is_hybrid:
            for layer, group in enumerate(self.group_of_layer):
                copier.save_layer(layer, s.block_ids[group], s.host_pages)
        else:
            copier.save(s.block_ids[0], s.host_pages)

    def _save_job(self, s: SaveSpec) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        error = None
        try:
            self._save_copy(s)
        except Exception as e:
            error = e
        cpu_s = time.thread_time() - cpu0  # read before the wall clock: within it
        self._saves_done([s], [error], time.perf_counter() - t0, cpu_s)

    def _saves_done(self, specs: list[SaveSpec], errors: list[Exception | None], seconds: float,
                    cpu_seconds: float = 0.0) -> None:
        """The saves' copies are complete (`errors`: per save, None or why it failed);
        `seconds` and `cpu_seconds` as for `_load_done`."""
        for error in errors:
            if error is not None:
                log.error("hicache: saving KV failed; the pages are dropped", exc_info=error)
        with self._lock:
            for s, error in zip(specs, errors):
                self._saved[s.put_id] = error is None
                self._saving[s.req_id] -= 1
                if not self._saving[s.req_id]:
                    del self._saving[s.req_id]
                if error is None:
                    self.stats.data["saved_tokens"] += len(s.host_pages) * self.shape.layout.page_size
            self.stats.data["save_s"] += seconds
            self.stats.data["save_cpu_s"] += cpu_seconds

    # -- reports ----------------------------------------------------------------------------
    def _poll(self) -> None:
        if self.streams is not None:
            self.streams.poll()

    def finished_sending(self) -> set[str] | None:
        """Finished requests whose blocks vLLM kept for our saves, now free to go."""
        self._poll()
        with self._lock:
            done = {r for r in self._delayed if r not in self._saving}
            self._delayed -= done
        return done or None

    def finished_recving(self) -> tuple[set[str], set[str]]:
        """Async loads (hybrid models) done since the last call, and those of them that failed."""
        self._poll()
        with self._lock:
            done, failed = self._recved, self._failed_reqs
            self._recved, self._failed_reqs = set(), set()
        return done, failed

    def worker_meta(self) -> HiCacheWorkerMeta | None:
        self._poll()
        with self._lock:
            if not self._saved and not self._loaded:
                return None
            meta = HiCacheWorkerMeta(self._saved, self._loaded)
            self._saved, self._loaded = {}, set()
        return meta

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_stats(self) -> HiCacheStats | None:
        self._poll()
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, HiCacheStats()
        return out

    # -- the copy thread --------------------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queued += 1
        self._jobs.put(job)

    def _run(self) -> None:
        pin_this_thread(self._copy_cpus)  # off the forward pass's cores (see affinity.py)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                with self._lock:
                    self._queued -= 1
                    if not self._queued:
                        self._idle.notify_all()

    def drain(self) -> None:
        """Wait until every queued copy has finished (and, on CUDA, report it)."""
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)
        if self.streams is not None:
            self.streams.sync()

    def close(self) -> None:
        self.drain()
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.client.close()
