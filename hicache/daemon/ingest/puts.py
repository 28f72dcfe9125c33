"""Host puts: pages an engine copies straight into the host tier, with no device residency.

Engines that keep their own device prefix cache (vLLM, SGLang) use hicache as
the tier below it. The daemon must never record their block ids as cached
device pages: the engine frees and reuses those blocks on its own. So instead
of insert + backup, such an engine stores a prefix in two steps:

  put       -> the daemon finds the leading run of the keys already on host,
               locks it (so the prefix the new pages hang under cannot go),
               and allocates host pages for the rest; the reply says where
               to copy which page.
  put_done  -> the copies are in place (ok) or failed: on ok the pages are
               inserted below the locked run and become host-resident (the
               disk tier hears of them as of any backup); otherwise they are
               freed. Either way the lock goes.

A put belongs to its namespace, not its connection: any engine registered in
the namespace may finish it (vLLM's scheduler reserves, its worker copies).
Engines of one namespace already trust each other's bytes. A put nobody
finishes expires after `lease_s` (its pages freed, its lock dropped), so a
worker that died mid-copy leaks nothing. A put outlives the connections of its
namespace's engines until that lease, on purpose: a worker whose connection
dropped may still be copying into its pages, and pages freed under it could be
handed to another put (or their slab to another namespace) and overwritten with
the wrong KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.daemon.core.service import CacheService, EngineRecord, NamespaceState
from hicache.index.node import Tier, TreeNode
from hicache.rpc.protocol import Code, RpcError

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Put:
    put_id: int
    engine: EngineRecord  # who reserved it (its namespace is the put's)
    under: TreeNode  # end of the host run the pages go below (HOST-locked unless the root)
    keys: list[bytes]  # of the pages to copy
    tokens: np.ndarray
    host_pages: np.ndarray
    deadline: float

    @property
    def ns(self) -> NamespaceState:
        return self.engine.ns


@dataclass(slots=True)
class PutCounters:
    puts: int = 0
    put_pages: int = 0  # pages reserved for copying
    committed_pages: int = 0
    failed: int = 0  # put_done(ok=False)
    expired: int = 0
    skipped_no_space: int = 0


class HostPuts:
    def __init__(self, service: CacheService, *, lease_s: float = 60.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.svc = service
        self.lease_s = lease_s
        self.clock = clock or time.monotonic  # leases are real time, whatever the index's clock
        self.puts: dict[int, Put] = {}  # insertion order is deadline order
        self.counters = PutCounters()

    def put(self, owner: object, engine_id: object, keys: list[bytes], tokens: np.ndarray
            ) -> tuple[Put | None, int]:
        """Reserve host pages for the keys not yet on host. Returns (the put, or None when
        nothing needs copying or there is no room; the number of leading pages already on host)."""
        self.expire()
        rec = self.svc.engine(owner, engine_id)
        ns = rec.ns
        if ns.namespace.state is not None:
            raise RpcError(Code.BAD_PARAMS, "hybrid namespaces store through insert (their checkpoints need it)")
        ps = ns.index.page_size
        if len(tokens) != len(keys) * ps:
            raise RpcError(Code.BAD_PARAMS, f"{len(keys)} keys need {len(keys) * ps} tokens, got {len(tokens)}")
        under, present = ns.index.host_prefix(keys)
        if present == len(keys):
            return None, present
        host_pages = self.svc.alloc_host(ns, len(keys) - present)
        if host_pages is None:
            self.counters.skipped_no_space += 1
            return None, present
        # Allocation may have evicted host pages; `under` was split off and is ours to lock
        # only if it survived (an unlocked node can go). Re-find the run, then lock it.
        under, still = ns.index.host_prefix(keys[:present])
        if still != present:
            ns.page_class.free(host_pages)
            self.counters.skipped_no_space += 1
            return None, still
        if not under.is_root:
            ns.index.lock(under, Tier.HOST)
        put = Put(next(self.svc._ids), rec, under, list(keys[present:]),
                  np.array(tokens[present * ps:], dtype="<i4"), host_pages, self.clock() + self.lease_s)
        self.puts[put.put_id] = put
        self.counters.puts += 1
        self.counters.put_pages += len(host_pages)
        return put, present

    def done(self, owner: object, engine_id: object, put_id: object, ok: bool) -> int:
        """Finish a put of this engine's namespace; returns the pages it added to the host tier."""
        rec = self.svc.engine(owner, engine_id)
        put = self.puts.get(put_id) if isinstance(put_id, int) else None
        if put is None or put.ns is not rec.ns:
            raise RpcError(Code.NOT_FOUND, f"no put {put_id!r} in this engine's namespace (expired?)")
        return self._finish(put, ok)

    def _finish(self, put: Put, ok: bool) -> int:
        del self.puts[put.put_id]
        ns, index = put.ns, put.ns.index
        stored: list[TreeNode] = []
        added = 0
        if ok:
            res = index.extend_host(put.under, put.keys, put.tokens, put.host_pages)
            if len(res.dup_host_pages):  # another put stored some of these pages meanwhile
                ns.page_class.free(res.dup_host_pages)
            added = len(put.host_pages) - len(res.dup_host_pages)
            stored = [n for n in res.nodes if n.host is not None]
            self.counters.committed_pages += added
        else:
            ns.page_class.free(put.host_pages)
            self.counters.failed += 1
        if not put.under.is_root:
            index.unlock(put.under, Tier.HOST)
        self.svc.reap(ns)
        if stored:
            self.svc.emit_nodes("stored", Tier.HOST, None, stored, ns)
            if self.svc.on_host_stored is not None:
                self.svc.on_host_stored(ns, stored)
        return added

    def expire(self) -> None:
        """Drop the puts whose lease ran out (their copies never reported)."""
        now = self.clock()
        while self.puts:
            put = next(iter(self.puts.values()))
            if put.deadline > now:
                break
            log.warning("put %d of engine %d expired unfinished; its %d host pages are freed", put.put_id,
                        put.engine.engine_id, len(put.host_pages))
            self.counters.expired += 1
            self._finish(put, ok=False)

    async def sweep(self, period_s: float = 1.0) -> None:
        """Expire leases on a clock, not only as puts come in: a put whose engines all went
        away must not hold its pages until the next put arrives."""
        while True:
            await asyncio.sleep(period_s)
            self.expire()
