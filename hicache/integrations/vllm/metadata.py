"""What the scheduler side tells the workers each step, what they tell it back,
and the connector's stats (vLLM ships all three between processes by pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass(slots=True)
class LoadSpec:
    """Copy host pages into the request's blocks, per namespace rank (pinned by the scheduler)."""

    req_id: str
    block_ids: list[int]
    host_pages: dict[int, list[int]]  # namespace rank -> pages, aligned with block_ids


@dataclass(slots=True)
class SaveSpec:
    """Copy the request's blocks into the pages a put reserved, on one namespace rank."""

    req_id: str
    rank: int
    put_id: int
    block_ids: list[int]
    host_pages: list[int]


@dataclass
class HiCacheMeta(KVConnectorMetadata):
    instance: str | None = None  # the daemon the scheduler's page ids come from
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


STAT_KEYS = ("loads", "loaded_tokens", "load_errors", "saved_tokens", "load_s", "save_s")


class HiCacheStats(KVConnectorStats):
    """Counts of one interval: loads (requests), loaded and saved tokens, blocks that failed
    to load, seconds spent copying in and out."""

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
                "save time (s)": round(d["save_s"], 4)}

    def is_empty(self) -> bool:
        return not any(self.data.values())
