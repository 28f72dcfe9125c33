"""Pages stored under keys the engine names: the storage API of SGLang's HiCache.

SGLang asks its L3 backend about pages by key (a chained SHA-256 of the
prefix), starting anywhere in a prefix: after its own host cache, in batches
of at most 128. hicache.integrations.sglang derives a 16-byte key and the
page's "tokens" from SGLang's key (hicache.client.keyed.named_page), so a key
commits to the page's whole prefix.

Chains. A store's pages hang in the radix tree one below the other, in batch
order, under the page SGLang names as the batch's prefix (`parent`: the last of
its prefix keys) when that page is stored; a page whose parent is unknown is
the root of its own chain, and is hung under its parent when that arrives
(RadixIndex.adopt). So leaf-first eviction takes a prompt's tail before its
head, as for every other engine. Lookups start mid-prefix, which a walk from
the root cannot answer: the namespace's index keeps a key -> node map
(hicache/index/key_map.py), and `exists` and `fetch` stay one lookup per key.

Everything else is the daemon's usual machinery: a store is a reservation of
the ingest protocol (protocol.py; owned by the engine's connection, freed when
the engine goes), host slots of the namespace's slabs, HOST/DISK locks,
write-through to the disk tier, disk prefetch into fresh host pages (with its
checksum check: a corrupt page is a miss), events. One round trip per batch:

  exists      -> how many leading keys are stored (host or disk).
  fetch       -> per key the host slot to copy from (-1: miss), disk pages
                 read first; all pinned under one match handle until `release`.
  store       -> per key a fresh host slot to copy into (-1: already stored);
                 nothing is visible until...
  store_done  -> the copies are in place: the pages enter the index (host),
                 and the disk tier writes them through.

The counters are the daemon's own, so `hicache stats`, the metrics and the hit
rates see these pages like any other: an `exists` is a lookup (requested pages,
and the leading stored run as hits of the tier each page is on), a fetch's
pages are loaded pages, and a store is a host put (puts.py's counters).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.daemon.core.service import CacheService, NamespaceState, Pin
from hicache.daemon.ingest.protocol import Reservation
from hicache.daemon.ingest.puts import PutCounters
from hicache.index.keys import PackedKeys
from hicache.index.radix import RadixIndex, Tier, TreeNode
from hicache.rpc.protocol import Code, RpcError

log = logging.getLogger(__name__)

MAX_KEYED_BATCH = 4096  # keys per call: SGLang sends at most 128; a bound on one loop turn's work
MAX_WAITING = 1 << 16  # chain roots remembered until their parent arrives (about 10 MB at most)
FETCH_WAIT_S = 30.0  # a disk read longer than this is given up (the pages stay on disk); the
                     # client's own deadline is shorter, this only bounds what a gone client leaves


@dataclass(slots=True, eq=False)
class KeyedBatch:
    """A store's pages, in chain order: what its commit hangs where."""

    keys: list[bytes]
    tokens: np.ndarray  # page_size tokens per key
    slots: np.ndarray  # host slot per key, -1 where the page was already stored
    parent: bytes | None  # the page before keys[0], when the engine named it


def _index(ns: NamespaceState) -> RadixIndex:
    ns.index.enable_key_map()  # once per namespace: its pages are asked about mid-path
    return ns.index


def _slot(node: TreeNode, key: bytes) -> int:
    return int(node.host[-1] if node.keys[-1] == key else node.host[node.keys.index(key)])


class KeyedPages:
    def __init__(self, service: CacheService, puts: PutCounters) -> None:
        self.service = service
        self.ingest = service.ingest
        self.puts = puts
        self.stored_pages = 0
        self.fetched_pages = 0
        self.linked = 0  # chain roots hung under a parent that arrived after them
        # chain roots whose parent page is not stored yet, by (namespace salt, the parent's key)
        self.waiting: dict[tuple[bytes, bytes], TreeNode] = {}

    # -- lookups ----------------------------------------------------------------
    @staticmethod
    def _stored(ns: NamespaceState, key: bytes, split: bool = False) -> TreeNode | None:
        """The page's node when it is on host or disk (a hit: its access time is refreshed)."""
        index = _index(ns)
        node = index.find_key(key, split=split)
        if node is None or (node.host is None and not node.on_disk):
            return None
        index.touch(node)
        return node

    def exists(self, owner: object, engine_id: Any, keys: PackedKeys) -> int:
        ns = self.service.engine(owner, engine_id).ns
        c = self.service.counters
        c.matches += 1
        c.requested_pages += len(keys)
        found = len(keys)
        for i, key in enumerate(keys):
            node = self._stored(ns, key)
            if node is None:
                found = i
                break
            c.matched_pages["host" if node.host is not None else "disk"] += 1
        adm = self.service.admission
        if adm is not None and ns.lookups_feed_admission:
            adm.request_pages(keys, found)
        return found

    async def fetch(self, owner: object, engine_id: Any, keys: PackedKeys, disk: Any) -> tuple[Pin, np.ndarray]:
        """Pin every stored page of `keys` on host, reading disk-only ones into fresh host
        pages first; returns the pin and a host slot per key (-1: not stored, or its disk
        copy could not be read or failed its checksum)."""
        svc = self.service
        rec = svc.engine(owner, engine_id)
        ns = rec.ns
        pin = Pin(next(svc._ids), rec, [], 0, 0, 0, None, np.empty(0, np.int64), np.empty(0, np.int64))
        svc.pins[pin.pin_id] = pin  # `release` and a dropped connection undo it like any match
        slots = np.full(len(keys), -1, dtype=np.int64)
        reading: list[tuple[int, bytes, Pin]] = []
        deepest: TreeNode | None = None  # of the run of host pages so far, each the child of the one before
        for i, key in enumerate(keys):
            # split: a restored run holds many pages; reading one must not read (and lock) the rest
            node = self._stored(ns, key, split=True)
            if node is None:
                continue
            if node.host is not None:
                slots[i] = _slot(node, key)
                # A lock counts on every ancestor: one on the deepest page of a chain run pins
                # the run (a lock per page would walk the chain once per page).
                if deepest is not None and node.parent is not deepest:
                    self._pin_host(pin, deepest)
                deepest = node
            elif disk is not None:
                # One read per page: DiskMover's prefetch hangs what it read on a path, and
                # these pages need not be one. Each read gets its own pin, folded in below.
                sub = Pin(next(svc._ids), rec, [], 0, 0, 1, None, pin.device_pages, pin.host_pages)
                svc.pins[sub.pin_id] = sub
                disk.prefetch(sub, [node])
                if sub.prefetch is None:  # no host page to read into
                    svc.release(owner, sub.pin_id)
                else:
                    reading.append((i, key, sub))
        if deepest is not None:
            self._pin_host(pin, deepest)
        if reading:
            futures = [sub.prefetch.future for _, _, sub in reading if not sub.prefetch.done]
            if futures:
                await asyncio.wait([asyncio.shield(f) for f in futures], timeout=FETCH_WAIT_S)
                await asyncio.sleep(0)  # DiskMover's done-callbacks run one loop turn after the futures
        for i, key, sub in reading:
            if sub.pin_id not in svc.pins:  # the connection went while we waited
                continue
            pf = sub.prefetch
            if not pf.done:  # still reading: released, its callback frees the pages it read into
                svc.release(owner, sub.pin_id)
                continue
            if pf.loaded_pages and pf.last_node is not None and pf.last_node.host is not None:
                slots[i] = _slot(pf.last_node, key)
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

    @staticmethod
    def _pin_host(pin: Pin, node: TreeNode) -> None:
        pin.engine.ns.index.lock(node, Tier.HOST)
        pin.locks.append((node, Tier.HOST, None))

    # -- stores -------------------------------------------------------------------
    def store(self, owner: object, engine_id: Any, keys: PackedKeys, tokens: np.ndarray,
              parent: bytes | None = None) -> Reservation | None:
        """Host slots for the keys not stored yet; None when the host tier has no room."""
        rec = self.service.engine(owner, engine_id)
        ns = rec.ns
        ps = ns.index.page_size
        if len(tokens) != len(keys) * ps:
            raise RpcError(Code.BAD_PARAMS, f"{len(keys)} keys need {len(keys) * ps} tokens, got {len(tokens)}")
        ns.lookups_feed_admission = True
        key_list = list(keys)
        missing = [i for i, k in enumerate(key_list) if self._stored(ns, k) is None]
        batch = KeyedBatch(key_list, tokens.copy(), np.full(len(key_list), -1, dtype=np.int64), parent)
        res = self.ingest.reserve("store", ns, len(missing), engine=rec, data=batch)
        if res is None:
            self.puts.skipped_no_space += 1
            return None
        batch.slots[missing] = res.host_pages
        self.puts.puts += 1
        self.puts.put_pages += len(missing)
        return res

    def store_done(self, owner: object, res_id: Any, ok: bool) -> int:
        """The engine copied its pages into the reserved slots (or failed: `ok` False).
        Returns how many pages entered the index (others stored them meanwhile: freed)."""
        res = self.ingest.lookup("store", res_id, owner=owner)
        if not ok:
            self.ingest.abort(res)
            self.puts.failed += 1
            return 0
        stored = self.ingest.commit(res, self._place, announce_as=res.engine)
        self.stored_pages += len(stored)
        self.puts.committed_pages += len(stored)
        return len(stored)

    def _place(self, res: Reservation) -> tuple[list[TreeNode], list[np.ndarray]]:
        """Hang the batch's pages one below the other, under its parent when that is stored;
        a chain root waits (by its parent's key) for that parent to arrive."""
        batch: KeyedBatch = res.data
        ns = res.ns
        index = _index(ns)
        ps = index.page_size
        prev = index.find_key(batch.parent, split=True) if batch.parent is not None else None
        wants = batch.parent if prev is None else None  # the parent the batch's first page waits for
        prev = prev if prev is not None else index.root
        stored: list[TreeNode] = []
        unused: list[np.ndarray] = []
        for i, key in enumerate(batch.keys):
            slot = batch.slots[i:i + 1]
            node = index.find_key(key, split=True)
            if node is None:
                if slot[0] < 0:  # stored at `store`, evicted since: the chain breaks here
                    prev, wants = index.root, None
                    continue
                node = index.extend_host(prev, [key], batch.tokens[i * ps:(i + 1) * ps], slot).nodes[-1]
                stored.append(node)
            elif slot[0] >= 0:
                if node.host is None:  # on disk only: it adopts our host copy
                    index.set_host(node, slot.copy())
                    stored.append(node)
                else:  # stored by another engine since `store`
                    unused.append(slot)
            if node.parent is index.root:
                if prev is not index.root:
                    self._link(index, prev, node)
                elif wants is not None:
                    self._wait_for(ns, wants, node)
            orphan = self.waiting.pop((ns.salt, key), None)
            if orphan is not None:  # a chain stored before this page, its parent
                self._link(index, node, orphan)
            prev, wants = node, None
        return stored, unused

    def _link(self, index: RadixIndex, parent: TreeNode, node: TreeNode) -> None:
        if not node.removed and not parent.removed and index.adopt(parent, node):
            self.linked += 1

    def _wait_for(self, ns: NamespaceState, parent_key: bytes, node: TreeNode) -> None:
        if len(self.waiting) >= MAX_WAITING:  # chains whose parent never came: forget the dead ones
            self.waiting = {k: n for k, n in self.waiting.items() if not n.removed and n.parent is not None
                            and n.parent.is_root}
            if len(self.waiting) >= MAX_WAITING:
                return
        self.waiting[(ns.salt, parent_key)] = node

    def stats(self) -> dict[str, int]:
        return {"stored_pages": self.stored_pages, "fetched_pages": self.fetched_pages,
                "reservations": self.ingest.pending("store"), "linked_chains": self.linked}
