"""Pages stored under keys the engine names, one by one: the storage API of SGLang's HiCache.

SGLang asks its L3 backend about pages by key (a chained SHA-256 of the
prefix), starting anywhere in a prefix: after its own host cache, in batches
of at most 128. A radix walk from the root cannot answer "is this key here"
for a key in the middle of a path it has not seen the start of, so these
pages are stored *flat*: every page is a one-page node directly under the
namespace's root, keyed by the engine (hicache.integrations.sglang derives a
16-byte key and the page's "tokens" from SGLang's key; the chain starts at the
namespace salt, so the disk rebuild verifies it like any other). Because
SGLang's key already commits to the whole prefix, flat storage loses nothing:
two pages share a key iff they share every token before them.

Everything else is the daemon's usual machinery: host slots of the
namespace's slabs, HOST/DISK locks, write-through to the disk tier, disk
prefetch into fresh host pages (with its checksum check: a corrupt page is a
miss), LRU eviction of whole nodes, events. One round trip per batch:

  exists      -> how many leading keys are stored (host or disk).
  fetch       -> per key the host slot to copy from (-1: miss), disk pages
                 read first; all pinned under one match handle until `release`.
  store       -> per key a fresh host slot to copy into (-1: already stored);
                 nothing is visible until...
  store_done  -> the copies are in place: the pages enter the index (host),
                 and the disk tier writes them through.

Pages a connection reserved and never committed are freed when its engine goes.

The counters are the daemon's own, so `hicache stats`, the metrics and the hit
rates see these pages like any other: an `exists` is a lookup (requested pages,
and the leading stored run as hits of the tier each page is on), a fetch's
pages are loaded pages, and a store is a host put (puts.py's counters).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.ingest.puts import PutCounters
from hicache.daemon.core.service import CacheService, EngineRecord, NamespaceState, Pin
from hicache.index.keys import PackedKeys
from hicache.index.radix import Tier, TreeNode
from hicache.rpc.framing import ids_to_bytes
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext

log = logging.getLogger(__name__)

MAX_KEYED_BATCH = 4096  # keys per call: SGLang sends at most 128; a bound on one loop turn's work
FETCH_WAIT_S = 30.0  # a disk read longer than this is given up (the pages stay on disk); the
                     # client's own deadline is shorter, this only bounds what a gone client leaves


@dataclass(slots=True, eq=False)
class Reservation:
    res_id: int
    engine: EngineRecord
    keys: list[bytes]
    tokens: np.ndarray  # page_size tokens per key
    slots: np.ndarray  # host slot per key, -1 where the page was already stored


class KeyedPages:
    def __init__(self, service: CacheService, puts: PutCounters) -> None:
        self.service = service
        self.puts = puts
        self.reservations: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self.stored_pages = 0
        self.fetched_pages = 0
        service.on_engine_gone.append(self._engine_gone)

    # -- lookups ----------------------------------------------------------------
    @staticmethod
    def _stored(ns: NamespaceState, key: bytes) -> TreeNode | None:
        """The page's node when it is on host or disk (a match also refreshes its LRU time)."""
        r = ns.index.match([key])
        return r.nodes[0] if r.nodes else None

    def exists(self, owner: object, engine_id: Any, keys: PackedKeys) -> int:
        ns = self.service.engine(owner, engine_id).ns
        c = self.service.counters
        c.matches += 1
        c.requested_pages += len(keys)
        for i, key in enumerate(keys):
            node = self._stored(ns, key)
            if node is None:
                return i
            c.matched_pages["host" if node.host is not None else "disk"] += 1
        return len(keys)

    async def fetch(self, owner: object, engine_id: Any, keys: PackedKeys, disk: Any) -> tuple[Pin, np.ndarray]:
        """Pin every stored page of `keys` on host, reading disk-only ones into fresh host
        pages first; returns the pin and a host slot per key (-1: not stored, or its disk
        copy could not be read or failed its checksum)."""
        svc = self.service
        rec = svc.engine(owner, engine_id)
        ns, index = rec.ns, rec.ns.index
        pin = Pin(next(svc._ids), rec, [], 0, 0, 0, None, np.empty(0, np.int64), np.empty(0, np.int64))
        svc.pins[pin.pin_id] = pin  # `release` and a dropped connection undo it like any match
        slots = np.full(len(keys), -1, dtype=np.int64)
        reading: list[tuple[int, Pin]] = []
        for i, key in enumerate(keys):
            node = self._stored(ns, key)
            if node is None:
                continue
            if node.host is not None:
                index.lock(node, Tier.HOST)
                pin.locks.append((node, Tier.HOST, None))
                slots[i] = node.host[0]
            elif disk is not None:
                # One read per page: DiskMover's prefetch hangs what it read on a path, and
                # these pages are siblings. Each read gets its own pin, folded in below.
                sub = Pin(next(svc._ids), rec, [], 0, 0, 1, None, pin.device_pages, pin.host_pages)
                svc.pins[sub.pin_id] = sub
                disk.prefetch(sub, [node])
                if sub.prefetch is None:  # no host page to read into
                    svc.release(owner, sub.pin_id)
                else:
                    reading.append((i, sub))
        if reading:
            futures = [sub.prefetch.future for _, sub in reading if not sub.prefetch.done]
            if futures:
                await asyncio.wait([asyncio.shield(f) for f in futures], timeout=FETCH_WAIT_S)
                await asyncio.sleep(0)  # DiskMover's done-callbacks run one loop turn after the futures
        for i, sub in reading:
            if sub.pin_id not in svc.pins:  # the connection went while we waited
                continue
            pf = sub.prefetch
            if not pf.done:  # still reading: released, its callback frees the pages it read into
                svc.release(owner, sub.pin_id)
                continue
            if pf.loaded_pages and pf.last_node is not None and pf.last_node.host is not None:
                slots[i] = pf.last_node.host[0]
                self.fetched_pages += 1
                pin.locks.extend(sub.locks)  # HOST on what arrived, DISK on what it read
                sub.locks.clear()
            # a page that could not be read (or failed its checksum) loses its disk copy here,
            # once its DISK lock goes: the next `exists` says it is not stored
            svc.release(owner, sub.pin_id)
        if pin.pin_id not in svc.pins:
            raise RpcError(Code.NOT_FOUND, "the connection went while reading from disk")
        svc.reap(ns)
        svc.counters.loaded_pages += int((slots >= 0).sum())
        return pin, slots

    # -- stores -------------------------------------------------------------------
    def store(self, owner: object, engine_id: Any, keys: PackedKeys, tokens: np.ndarray) -> Reservation | None:
        """Host slots for the keys not stored yet; None when the host tier has no room."""
        svc = self.service
        rec = svc.engine(owner, engine_id)
        ns = rec.ns
        ps = ns.index.page_size
        if len(tokens) != len(keys) * ps:
            raise RpcError(Code.BAD_PARAMS, f"{len(keys)} keys need {len(keys) * ps} tokens, got {len(tokens)}")
        key_list = list(keys)
        missing = [i for i, k in enumerate(key_list) if self._stored(ns, k) is None]
        slots = np.full(len(key_list), -1, dtype=np.int64)
        if missing:
            got = svc.alloc_host(ns, len(missing))
            if got is None:
                self.puts.skipped_no_space += 1
                return None
            slots[missing] = got
        self.puts.puts += 1
        self.puts.put_pages += len(missing)
        res = Reservation(next(self._ids), rec, key_list, tokens.copy(), slots)
        self.reservations[res.res_id] = res
        return res

    def store_done(self, owner: object, res_id: Any, ok: bool) -> int:
        """The engine copied its pages into the reserved slots (or failed: `ok` False).
        Returns how many pages entered the index (others stored them meanwhile: freed)."""
        svc = self.service
        res = self.reservations.get(res_id) if isinstance(res_id, int) else None
        if res is None or res.engine.owner is not owner:
            raise RpcError(Code.NOT_FOUND, f"no store {res_id!r} on this connection")
        del self.reservations[res_id]
        ns = res.engine.ns
        mine = res.slots >= 0
        if not ok:
            ns.page_class.free(res.slots[mine])
            self.puts.failed += 1
            return 0
        ps = ns.index.page_size
        stored: list[TreeNode] = []
        spare: list[int] = []
        for i in np.flatnonzero(mine).tolist():
            slot = res.slots[i:i + 1]
            r = ns.index.insert([res.keys[i]], res.tokens[i * ps:(i + 1) * ps], host_pages=slot)
            if r.new_nodes:
                stored.extend(r.new_nodes)
            elif len(r.dup_host_pages):  # stored by another engine since `store`
                spare.append(int(slot[0]))
            else:  # the page was on disk only: it adopted our host copy
                stored.append(r.nodes[0])
        if spare:
            ns.page_class.free(np.asarray(spare, dtype=np.int64))
        self.stored_pages += len(stored)
        self.puts.committed_pages += len(stored)
        if stored:
            svc.emit_nodes("stored", Tier.HOST, res.engine, stored)
            if svc.on_host_stored is not None:
                svc.on_host_stored(ns, stored)  # write-through to disk
        return len(stored)

    def _engine_gone(self, rec: EngineRecord) -> None:
        for res in [r for r in self.reservations.values() if r.engine is rec]:
            del self.reservations[res.res_id]
            rec.ns.page_class.free(res.slots[res.slots >= 0])

    def stats(self) -> dict[str, int]:
        return {"stored_pages": self.stored_pages, "fetched_pages": self.fetched_pages,
                "reservations": len(self.reservations)}


def keyed_handlers(daemon: DaemonContext, keys_of: Any) -> dict[str, Any]:
    """RPC methods over KeyedPages; `keys_of` checks and splits a request's packed keys."""
    svc = daemon.service
    assert svc is not None
    assert daemon.puts is not None
    pages = KeyedPages(svc, daemon.puts.counters)

    def batch(p: dict) -> PackedKeys:
        keys = keys_of(p)
        if len(keys) > MAX_KEYED_BATCH:
            raise RpcError(Code.BAD_PARAMS, f"more than {MAX_KEYED_BATCH} keys in one keyed call")
        return keys

    def exists(conn: Any, p: dict) -> Any:
        return {"present": pages.exists(conn, p.get("engine"), batch(p))}

    async def fetch(conn: Any, p: dict) -> Any:
        pin, slots = await pages.fetch(conn, p.get("engine"), batch(p), daemon.disk)
        return {"pin": pin.pin_id, "host_pages": ids_to_bytes(slots),
                "slabs": daemon.host.slab_version(pin.engine.ns.salt)}

    def store(conn: Any, p: dict) -> Any:
        keys = batch(p)
        tokens = p.get("tokens")
        if not isinstance(tokens, bytes) or len(tokens) % 4:
            raise RpcError(Code.BAD_PARAMS, "tokens must be packed int32")
        res = pages.store(conn, p.get("engine"), keys, np.frombuffer(tokens, dtype="<i4"))
        if res is None:
            return {"store": None}
        return {"store": res.res_id, "host_pages": ids_to_bytes(res.slots),
                "slabs": daemon.host.slab_version(res.engine.ns.salt)}

    def store_done(conn: Any, p: dict) -> Any:
        ok = p.get("ok", True)
        if not isinstance(ok, bool):
            raise RpcError(Code.BAD_PARAMS, "parameter 'ok' must be a bool")
        return {"stored": pages.store_done(conn, p.get("store"), ok)}

    return {"exists": exists, "fetch": fetch, "store": store, "store_done": store_done}
