"""What the scheduler side tells the workers each step, what they tell it back,
and the connector's stats (vLLM ships all three between processes by pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclass(slots=True)
class LoadSpec:
    """Copy host pages into the request's blocks, per namespace rank (pinned by the scheduler)."""

    req_id: str
    block_ids: list[list[int]]  # per KV cache group, aligned with the pages (a null block: not needed)
    host_pages: dict[int, list[int]]  # namespace rank -> pages
    stale: bool = False  # the pages cannot be had: report the blocks (the request, if async) failed


@dataclass(slots=True)
class SaveSpec:
    """Copy the request's blocks into the pages a put reserved, on one namespace rank."""

    req_id: str
    rank: int
    put_id: int
    block_ids: list[list[int]]  # per KV cache group, aligned with host_pages
    host_pages: list[int]


@dataclass
class HiCacheMeta(KVConnectorMetadata):
    instances: dict[int, str | None] = field(default_factory=dict)  # namespace rank -> daemon of its page ids
    slabs: dict[int, int] = field(default_factory=dict)  # namespace rank -> slab version those pages need
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)  # finished requests whose blocks wait for their saves
    preempted: bool = False


@dataclass
class HiCacheWorkerMeta(KVConnectorWorkerMetadata):
    saved: dict[int, bool] = field(default_factory=dict)  # put id -> copies ok
    loaded: set[str] = field(default_factory=set)  # requests whose loads finished (ok or not) this step

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiCacheWorkerMeta)
        return HiCacheWorkerMeta({**self.saved, **other.saved}, self.loaded | other.loaded)


STAT_KEYS = ("loads", "loaded_tokens", "load_errors", "saved_tokens", "load_s", "save_s", "load_cpu_s", "save_cpu_s",
             "step_s")


class HiCacheStats(KVConnectorStats):
    """Counts of one interval: loads (requests), loaded and saved tokens, blocks that failed
    to load, seconds spent copying in and out (on the copy thread: wall time, and the
    thread's CPU time in it, so a rate can tell the copy's own speed from its waits for a
    core), and seconds the engine's step spent inside the connector's calls (scheduler and
    worker: what it adds to a step)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict.fromkeys(STAT_KEYS, 0) | dict(data or {}))

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {"hicache loads": d["loads"], "loaded tokens": d["loaded_tokens"], "saved tokens": d["saved_tokens"],
                "load errors": d["load_errors"], "load time (s)": round(d["load_s"], 4),
                "save time (s)": round(d["save_s"], 4), "load CPU time (s)": round(d["load_cpu_s"], 4),
                "save CPU time (s)": round(d["save_cpu_s"], 4), "step time (s)": round(d["step_s"], 4)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


PROM_COUNTERS = {  # stat -> (metric name, help)
    "loads": ("vllm:hicache_loads", "Requests whose prefix hicache loaded."),
    "loaded_tokens": ("vllm:hicache_loaded_tokens", "Tokens of KV loaded from hicache."),
    "saved_tokens": ("vllm:hicache_saved_tokens", "Tokens of KV stored into hicache."),
    "load_errors": ("vllm:hicache_load_error_blocks", "Blocks hicache failed to load (vLLM recomputed them)."),
    "load_s": ("vllm:hicache_load_seconds", "Seconds spent copying KV in from hicache."),
    "save_s": ("vllm:hicache_save_seconds", "Seconds spent copying KV out to hicache."),
    "load_cpu_s": ("vllm:hicache_load_cpu_seconds",
                   "CPU seconds the copy thread spent copying KV in (of hicache_load_seconds; CPU path)."),
    "save_cpu_s": ("vllm:hicache_save_cpu_seconds",
                   "CPU seconds the copy thread spent copying KV out (of hicache_save_seconds; CPU path)."),
    "step_s": ("vllm:hicache_step_seconds", "Seconds engine steps spent inside the hicache connector's calls."),
}


class HiCachePromMetrics(KVConnectorPromMetrics):
    """The connector's stats as Prometheus counters, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            stat: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                           per_engine_labelvalues)
            for stat, (name, doc) in PROM_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for stat, per_engine in self.counters.items():
            value = transfer_stats_data.get(stat, 0)
            if value:
                per_engine[engine_idx].inc(value)
