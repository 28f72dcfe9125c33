"""The one way host pages enter the index: reserve -> copy -> commit.

Every path that brings KV pages into the host tier goes through `Ingest`:
the engine cycle's backups (service.py), vLLM's host puts (puts.py), SGLang's
keyed stores (keyed.py) and the remote tier's fetches (movers/remote_mover.py).
They differ only in where the pages hang in the index; what they share is
written here once:

  reserve -> host pages of the namespace's slabs (evicting, or taking a slab
             from another namespace, as the engine cycle's `alloc_host` does);
             then the *anchor* is locked: what the copy reads from or the pages
             will hang below (a backup's device copies, the host run a put
             continues), so eviction cannot take it mid-copy. An anchor that did
             not survive the allocation gives the pages back.
  (copy)  -> the engine (or the remote worker) writes the pages' bytes.
  commit  -> `place` puts the pages into the index and says which nodes now
             hold them and which pages went unused (stored meanwhile by someone
             else); the unused are freed, the locks drop, nodes left in no tier
             are reaped, and the stored nodes are announced: a "stored" host
             event and the disk tier's write-through.
  abort   -> the copy failed or nobody finished it: the pages are freed, the
             locks drop.

Ownership, one of three:
  connection -> `engine` set, no lease: only the engine's connection finishes it,
                and it is aborted when that engine goes (backups, keyed stores).
  namespace  -> a lease: any engine of the namespace finishes it (vLLM's scheduler
                reserves, its worker copies), and it outlives the engines'
                connections until `deadline`, when `expire` aborts it: a worker
                whose connection dropped may still be copying into its pages.
  daemon     -> no engine (a remote fetch): its mover finishes it.

Not through here, on purpose: hybrid models' state checkpoints (slots of their own
budget, set on nodes that exist already: hybrid/states.py) and disk prefetches (host
copies of pages the index already holds, read by movers/disk_mover.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hicache.daemon.core.records import EMPTY, EngineRecord, NamespaceState
from hicache.index.node import Tier, TreeNode
from hicache.rpc.protocol import Code, RpcError

log = logging.getLogger(__name__)

Lock = tuple[TreeNode, Tier, int | None]  # (node, tier, engine for DEVICE locks), as Pin.locks


@dataclass(slots=True, eq=False)
class Reservation:
    res_id: int
    kind: str  # "backup", "put", "store", "fetch": the wire method that finishes it
    ns: NamespaceState
    engine: EngineRecord | None  # who reserved it; None: the daemon's own (a remote fetch)
    host_pages: np.ndarray  # the pages to copy into, in the caller's order
    locks: list[Lock] = field(default_factory=list)  # the anchor, held until commit or abort
    deadline: float | None = None  # a lease: owned by the namespace until then
    data: Any = None  # the caller's own: what `place` needs (keys, tokens, ranges, ...)


class HostBudget(Protocol):
    """What the protocol needs of the engine cycle (CacheService): no import of it."""

    on_host_stored: Callable[[NamespaceState, list[TreeNode]], None] | None

    def alloc_host(self, ns: NamespaceState, n_pages: int) -> np.ndarray | None: ...
    def reap(self, ns: NamespaceState) -> None: ...
    def emit_nodes(self, kind: str, tier: Tier, rec: EngineRecord | None, nodes: list[TreeNode],
                   ns: NamespaceState | None = None) -> None: ...


# place(reservation) -> (nodes now holding its pages, pages it did not use)
Place = Callable[[Reservation], tuple[list[TreeNode], list[np.ndarray]]]


class Ingest:
    def __init__(self, budget: HostBudget, ids: Iterator[int] | None = None) -> None:
        self.budget = budget
        self._ids = ids if ids is not None else itertools.count(1)
        self.reservations: dict[int, Reservation] = {}
        self._leased: dict[int, Reservation] = {}  # insertion order is deadline order (one lease length)

    # -- reserve ------------------------------------------------------------------
    def reserve(self, kind: str, ns: NamespaceState, n_pages: int, *, engine: EngineRecord | None,
                anchor: Callable[[], list[Lock] | None] | None = None, deadline: float | None = None,
                data: Any = None) -> Reservation | None:
        """n_pages host pages and the anchor's locks; None when the host tier has no room
        or the anchor (asked for after allocating, which may evict) is gone."""
        pages = self.budget.alloc_host(ns, n_pages) if n_pages else EMPTY
        if pages is None:
            return None
        locks = anchor() if anchor is not None else []
        if locks is None:
            if len(pages):
                ns.page_class.free(pages)
            return None
        for node, tier, eng in locks:
            ns.index.lock(node, tier, eng)
        res = Reservation(next(self._ids), kind, ns, engine, pages, locks, deadline, data)
        self.reservations[res.res_id] = res
        if deadline is not None:
            self._leased[res.res_id] = res
        return res

    def lookup(self, kind: str, res_id: object, *, owner: object = None,
               engine: EngineRecord | None = None) -> Reservation:
        """The reservation a finishing call names, if the caller may finish it: the
        connection that reserved it, or (for a lease) any engine of its namespace."""
        res = self.reservations.get(res_id) if isinstance(res_id, int) else None
        if res is not None and res.kind == kind:
            if res.deadline is not None:
                if engine is not None and res.ns is engine.ns:
                    return res
            elif res.engine is not None and res.engine.owner is owner:
                return res
        where = "in this engine's namespace (expired?)" if kind == "put" else "on this connection"
        raise RpcError(Code.NOT_FOUND, f"no {kind} {res_id!r} {where}")

    # -- commit / abort -------------------------------------------------------------
    def commit(self, res: Reservation, place: Place, *, announce_as: EngineRecord | None = None,
               write_through: Callable[[NamespaceState, list[TreeNode]], None] | None | bool = True,
               then: Callable[[], None] | None = None) -> list[TreeNode]:
        """The copies are in place: `place` puts the pages into the index (its anchor still
        locked); returns the nodes it stored. `write_through` True: the engine cycle's hook
        (the disk tier's write-through, and the remote tier's); a callable: that one instead."""
        stored, unused = place(res)
        self._settle(res, unused, then)
        if stored:
            ns = res.ns
            self.budget.emit_nodes("stored", Tier.HOST, announce_as, stored, ns)
            hook = self.budget.on_host_stored if write_through is True else write_through
            if hook:
                hook(ns, stored)
        return stored

    def abort(self, res: Reservation, then: Callable[[], None] | None = None) -> None:
        """The copy failed or will never be reported: the pages go back, the locks drop."""
        self._settle(res, [res.host_pages], then)

    def _settle(self, res: Reservation, unused: list[np.ndarray], then: Callable[[], None] | None) -> None:
        self.reservations.pop(res.res_id, None)
        self._leased.pop(res.res_id, None)
        index = res.ns.index
        for node, tier, eng in res.locks:
            index.unlock(node, tier, eng)
        res.locks.clear()
        if then is not None:
            then()
        unused = [u for u in unused if len(u)]
        if unused:
            res.ns.page_class.free(np.concatenate(unused) if len(unused) > 1 else unused[0])
        self.budget.reap(res.ns)

    # -- cleanup ----------------------------------------------------------------------
    def owned_by(self, kind: str, match: Callable[[EngineRecord], bool]) -> list[Reservation]:
        """The connection-owned reservations of `kind` whose engine matches."""
        return [r for r in self.reservations.values()
                if r.kind == kind and r.deadline is None and r.engine is not None and match(r.engine)]

    def engine_gone(self, rec: EngineRecord) -> None:
        """Abort what the engine's connection owned; leases stay theirs until they expire."""
        for res in [r for r in self.reservations.values() if r.engine is rec and r.deadline is None]:
            self.abort(res)

    def expire(self, now: float) -> list[Reservation]:
        """Abort the leases that ran out (their copies never reported); returns them."""
        gone: list[Reservation] = []
        while self._leased:
            res = next(iter(self._leased.values()))
            if res.deadline > now:
                break
            log.warning("%s %d of engine %d expired unfinished; its %d host pages are freed", res.kind,
                        res.res_id, res.engine.engine_id if res.engine else -1, len(res.host_pages))
            self.abort(res)
            gone.append(res)
        return gone

    def pending(self, kind: str) -> int:
        return sum(1 for r in self.reservations.values() if r.kind == kind)
