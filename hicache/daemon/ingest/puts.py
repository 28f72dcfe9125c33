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
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.daemon.core.service import CacheService
from hicache.daemon.ingest.protocol import Reservation
from hicache.index.node import Tier, TreeNode
from hicache.rpc.protocol import Code, RpcError


@dataclass(slots=True, eq=False)
class PutTarget:
    """Where a put's pages go: below `under`, the end of the host run the keys start with."""

    under: TreeNode  # HOST-locked (the reservation's anchor) unless the root
    keys: list[bytes]  # of the pages to copy
    tokens: np.ndarray


@dataclass(slots=True)
class PutCounters:
    puts: int = 0
    put_pages: int = 0  # pages reserved for copying
    committed_pages: int = 0
    failed: int = 0  # put_done(ok=False)
    expired: int = 0
    skipped_no_space: int = 0


def place_put(res: Reservation) -> tuple[list[TreeNode], list[np.ndarray]]:
    """The pages continue the path at `under` (still locked): no walk from the root."""
    target: PutTarget = res.data
    r = res.ns.index.extend_host(target.under, target.keys, target.tokens, res.host_pages)
    # dups: another put stored some of these pages meanwhile
    return [n for n in r.nodes if n.host is not None], [r.dup_host_pages]


class HostPuts:
    def __init__(self, service: CacheService, *, lease_s: float = 60.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.svc = service
        self.ingest = service.ingest
        self.lease_s = lease_s
        self.clock = clock or time.monotonic  # leases are real time, whatever the index's clock
        self.counters = PutCounters()

    @property
    def puts(self) -> dict[int, Reservation]:
        """The puts reserved and not finished yet."""
        return {r.res_id: r for r in self.ingest.reservations.values() if r.kind == "put"}

    def put(self, owner: object, engine_id: object, keys: list[bytes], tokens: np.ndarray
            ) -> tuple[Reservation | None, int]:
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
        ns.lookups_feed_admission = True
        _, present = ns.index.host_prefix(keys)
        if present == len(keys):
            return None, present
        found: list[int] = [present]
        target = PutTarget(ns.index.root, list(keys[present:]), np.array(tokens[present * ps:], dtype="<i4"))

        def anchor() -> list | None:
            # Allocation may have evicted host pages; the run is ours to lock only if it
            # survived (an unlocked node can go). Re-find it, then lock it.
            target.under, found[0] = ns.index.host_prefix(keys[:present])
            if found[0] != present:
                return None
            return [] if target.under.is_root else [(target.under, Tier.HOST, None)]

        put = self.ingest.reserve("put", ns, len(keys) - present, engine=rec, anchor=anchor,
                                  deadline=self.clock() + self.lease_s, data=target)
        if put is None:
            self.counters.skipped_no_space += 1
            return None, found[0]
        self.counters.puts += 1
        self.counters.put_pages += len(put.host_pages)
        return put, present

    def done(self, owner: object, engine_id: object, put_id: object, ok: bool) -> int:
        """Finish a put of this engine's namespace; returns the pages it added to the host tier."""
        rec = self.svc.engine(owner, engine_id)
        return self._finish(self.ingest.lookup("put", put_id, engine=rec), ok)

    def _finish(self, put: Reservation, ok: bool) -> int:
        if not ok:
            self.ingest.abort(put)
            self.counters.failed += 1
            return 0
        used: list[int] = []

        def place(res: Reservation) -> tuple[list[TreeNode], list[np.ndarray]]:
            stored, unused = place_put(res)
            used.append(len(res.host_pages) - len(unused[0]))
            return stored, unused

        self.ingest.commit(put, place)
        self.counters.committed_pages += used[0]
        return used[0]

    def expire(self) -> None:
        """Drop the puts whose lease ran out (their copies never reported)."""
        self.counters.expired += len(self.ingest.expire(self.clock()))

    async def sweep(self, period_s: float = 1.0) -> None:
        """Expire leases on a clock, not only as puts come in: a put whose engines all went
        away must not hold its pages until the next put arrives."""
        while True:
            await asyncio.sleep(period_s)
            self.expire()
