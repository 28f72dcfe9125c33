"""HiCacheConnector: vLLM's v1 KV connector API, on hicache's host and disk tiers.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"HiCacheConnector",
      "kv_connector_module_path":"hicache.integrations.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"socket":"/run/hicache/hicache.sock"}}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one
per worker (role WORKER); each delegates to its side (scheduler.py, worker.py).
Extra config keys, all optional: `socket` (default: the daemon's default
socket), `model_id` (the namespace's model name; default vLLM's model path or
name), `lease_s` (pins a load never reports are released after it),
`kv_events_max_blocks` (blocks the KV event map follows, events.py), `deadlines`
(seconds the connector waits for the daemon: one number, or per call kind as in
hicache/client/deadlines.py, e.g. {"match_s": 1.0}; raise them on a machine whose
daemon may be starved of CPU, at the cost of a slower miss when it hangs),
`prefill_tokens_per_s` (the engine's prefill rate: with it the daemon leaves a disk or
remote part to be recomputed when that is faster than reading it, and a request waits
for a lookup's answer at most as long as computing what it covers takes; without it
every cached page is loaded and the wait is bounded by the scheduler's measured rate).
vLLM's `kv_load_failure_policy` is set to "recompute": a block hicache could not
load is computed, never an error.

It supports vLLM's hybrid KV cache manager (`SupportsHMA`): models whose KV cache
groups are full-attention and sliding-window layers of one page shape are cached
with every group's blocks (layout.py); models with Mamba / linear-attention groups
are refused at start with UnsupportedModel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.client.deadlines import CallDeadlines
from hicache.integrations.vllm.events import bridge_for
from hicache.integrations.vllm.layout import engine_shape
from hicache.integrations.vllm.metadata import HiCacheMeta, HiCachePromMetrics, HiCacheStats
from hicache.integrations.vllm.scheduler import SchedulerSide
from hicache.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class _StepClock:
    """Seconds the engine spends inside the connector's calls on its step path, between two
    stats reports: what the connector adds to a step (its copies run on their own thread). vLLM
    makes these calls from one thread per role."""

    __slots__ = ("seconds", "_t0")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        socket = cfg.get_from_extra_config("socket", None)
        shape = engine_shape(vllm_config, kv_cache_config, cfg.get_from_extra_config("model_id", None))
        dl = cfg.get_from_extra_config("deadlines", None)
        deadlines = CallDeadlines.from_config(dl) if dl is not None else None
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self._clock = _StepClock()
        num_blocks = int(kv_cache_config.num_blocks)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A cache tier must never fail a request: a block that did not load is recomputed.
            # vLLM reads this policy right after building the scheduler's connector.
            if cfg.kv_load_failure_policy != "recompute":
                log.info("hicache: kv_load_failure_policy set to 'recompute' (a failed load is a miss)")
                cfg.kv_load_failure_policy = "recompute"
            rate = cfg.get_from_extra_config("prefill_tokens_per_s", None)
            if cfg.get_from_extra_config("disk_wait_s", None) is not None:
                log.warning("hicache: disk_wait_s is ignored: a request waits for its disk or remote part as "
                            "long as loading it saves compute (prefill_tokens_per_s, or the measured rate)")
            self.scheduler = SchedulerSide(shape, num_blocks, socket, deadlines=deadlines,
                                           lease_s=float(cfg.get_from_extra_config("lease_s", 30.0)),
                                           prefill_tokens_per_s=None if rate is None else float(rate))
            self.scheduler.events = bridge_for(vllm_config, kv_cache_config, self.scheduler.clients,
                                               shape.layout.page_size,
                                               int(cfg.get_from_extra_config("kv_events_max_blocks", 65536)))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = WorkerSide(shape, num_blocks, socket, get_tensor_model_parallel_rank(), deadlines)
        log.info("hicache connector (%s): namespace %s", role.name, shape)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, nothing more

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        assert self.worker is not None
        self.worker.register(kv_caches, extract_layer_index)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, HiCacheMeta)
        with self._clock:
            self.worker.before_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheMeta)
        with self._clock:
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        with self._clock:
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward pass (wait_for_save), all layers at once

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheMeta)
        with self._clock:
            self.worker.start_saves(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done for finished requests; async loads (hybrid models) done, and failed."""
        assert self.worker is not None
        with self._clock:
            recving, failed = self.worker.finished_recving()
            return KVConnectorTransferResults(set(self.worker.finished_sending() or ()), recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self) -> HiCacheStats | None:
        stats = self.worker.take_stats() if self.worker is not None else None
        step_s = self._clock.take()
        if step_s:
            stats = stats or HiCacheStats()
            stats.data["step_s"] += step_s
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiCacheStats:
        return HiCacheStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> HiCachePromMetrics:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        with self._clock:
            return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        with self._clock:
            self.scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.scheduler is not None:
            self.scheduler.null_block = gpu_block_pool.null_block.block_id

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(self.num_groups))  # a page holds every group's layers

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiCacheMeta:
        assert self.scheduler is not None
        with self._clock:
            return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        with self._clock:
            self.scheduler.on_output(connector_output.kv_connector_worker_meta, connector_output.failed_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        with self._clock:
            return self.scheduler.request_finished(request), None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        with self._clock:
            return self.scheduler.request_finished(request), None

    def has_pending_push_work(self) -> bool:
        sched = self.scheduler
        return sched is not None and (sched.has_pending_saves() or (sched.events is not None and sched.events.pending))

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self.scheduler.events if self.scheduler is not None else None
        if events is None:
            return ()
        with self._clock:
            return events.take_events()

    def reset_cache(self) -> bool | None:
        return None  # the daemon's tiers are shared by other engines: `hicache flush` clears them
