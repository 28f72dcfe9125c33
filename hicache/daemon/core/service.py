"""CacheService: the engine cycle, as plain methods over the index and the host tier.

No sockets and no awaits here: the RPC layer decodes parameters, calls one
method, and encodes what it returns. Everything runs on the event-loop
thread, so the index needs no locks.

The cycle, for one request of engine E:
  match      -> E's device pages for the prefix it already holds, then host
                pages it can load, then the length available on disk (when
                reading it beats recomputing it: fetch_or_recompute.py); the
                returned path is pinned (lock refs) until `release`.
  load_done  -> E copied the host part into its device pages: E's device
                residency is recorded.
  insert     -> E computed the rest; the daemon records it and, under
                write-through, returns a backup plan into fresh host pages.
  backup_done-> the host copies are valid: the pages become host-resident.
  evict      -> E needs device pages back: LRU device leaves of E are chosen;
                under write-back those lacking a host copy are backed up first.
  release    -> E finished the request: its pins go.

Backups (insert's, evict's) are reservations of the ingest protocol
(hicache/daemon/ingest/protocol.py, ingest/backups.py), as every other way host
pages come in; this class is the host budget that protocol draws on (alloc_host,
with the rest of the eviction side, in eviction.py).

Trust model: keys are computed by the client (hashing 8K tokens costs more
than the whole round trip), but every key lives in the radix tree of the
namespace the engine registered, and the daemon computes that namespace's
salt itself; engines sharing a namespace already trust each other's bytes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.daemon.core.eviction import TierEviction
from hicache.daemon.core.fetch_or_recompute import FetchOrRecompute
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.records import (  # noqa: F401  (NamespaceState, Pin, path_with_offsets: re-exported)
    EMPTY, TIER_NAMES, Counters, EngineRecord, NamespaceState, Pin, path_with_offsets,
)
from hicache.daemon.ingest.backups import PendingBackup, place_backup, plan_backup
from hicache.daemon.ingest.protocol import Ingest
from hicache.daemon.core.validation import check_device_pages
from hicache.index.admission import DiskAdmission
from hicache.index.keys import Namespace
from hicache.index.node import IndexStateError, Tier, TreeNode
from hicache.index.policy import EvictionPolicy, LruPolicy
from hicache.index.radix import RadixIndex
from hicache.rpc.protocol import Code, RpcError
from hicache.transfer.policy import WritePolicy

log = logging.getLogger(__name__)


class CacheService(TierEviction):  # alloc_host, evict_host/disk, flush, evict_tier: eviction.py
    def __init__(self, host: HostTier, *, write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
                 write_hit_threshold: int = 2, emit: Callable[[dict], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, max_device_pages: int = 1 << 24,
                 eviction_policy: EvictionPolicy | None = None) -> None:
        self.host = host
        # One policy for every namespace: their priorities are compared when they share a tier.
        self.eviction_policy = eviction_policy if eviction_policy is not None else LruPolicy()
        self.max_device_pages = max_device_pages  # per engine (Config.max_device_pages)
        self.write_policy = write_policy
        self.write_hit_threshold = write_hit_threshold
        self.emit = emit or (lambda event: None)
        self.clock = clock
        self.namespaces: dict[bytes, NamespaceState] = {}
        self.engines: dict[int, EngineRecord] = {}
        self.pins: dict[int, Pin] = {}
        self.counters = Counters()
        self._ids = itertools.count(1)
        self.ingest = Ingest(self, self._ids)  # every way host pages come in (ingest/protocol.py)
        self._stale_disk: list[tuple[NamespaceState, TreeNode]] = []
        # Hook for the disk tier: called with (ns, nodes) once pages become host-resident,
        # and asked to demote pages before their host copies are dropped.
        self.on_host_stored: Callable[[NamespaceState, list[TreeNode]], None] | None = None
        self.before_host_evict: Callable[[NamespaceState, int], None] | None = None
        self.on_disk_freed: Callable[[NamespaceState, list[bytes]], None] | None = None
        self.on_match: Callable[[Pin, list[TreeNode]], None] | None = None  # starts disk prefetch
        # Which pages the tiers below the host take (hicache/index/admission.py); it hears
        # every inserted request. None: every page is written.
        self.admission: DiskAdmission | None = None
        # Whether a disk or remote part of a match is worth loading (fetch_or_recompute.py);
        # None: always.
        self.fetch_cost: FetchOrRecompute | None = None
        # Hybrid models: HybridStates (hicache/daemon/hybrid/states.py) keeps state checkpoints beside
        # the KV; it hears of every dropped pin of a hybrid namespace (its checkpoint locks go with
        # it). The disk tier hears of dropped pins that carry a prefetch (pin.prefetch). Other
        # pins, most of them, have nothing for a hook: drop_pin skips the call.
        self.hybrid: Any = None
        self.on_pin_dropped: Callable[[Pin], None] | None = None
        # Tenant quotas (hicache/daemon/core/quotas.py): with a quota on a tier, host pages
        # and the disk's room are taken by their rules instead of the eviction policy alone.
        self.quotas: Any = None

    @property
    def backups(self) -> dict[int, PendingBackup]:
        """The backups planned and not reported yet."""
        return {r.res_id: r.data for r in self.ingest.reservations.values() if r.kind == "backup"}

    # -- registry ---------------------------------------------------------
    def namespace_state(self, namespace: Namespace, index: RadixIndex | None = None) -> NamespaceState:
        """Made on first use (`index`: built already, by the disk restore, with our policy and clock)."""
        salt = namespace.salt()
        ns = self.namespaces.get(salt)
        if ns is None:
            cls = self.host.page_class(salt, namespace.layout.page_bytes)
            index = index or RadixIndex(namespace.layout.page_size, salt, self.eviction_policy, self.clock)
            ns = NamespaceState(namespace, salt, index, cls)
            self.namespaces[salt] = ns
        return ns

    def register(self, owner: object, namespace: Namespace, device_pages: int) -> EngineRecord:
        if not 0 < device_pages <= self.max_device_pages:
            raise RpcError(Code.BAD_PARAMS, f"device_pages must be in 1..{self.max_device_pages}")
        try:
            ns = self.namespace_state(namespace)
        except Exception as e:  # a page too large for the arena, ...
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        rec = EngineRecord(next(self._ids), owner, ns, device_pages)
        self.engines[rec.engine_id] = rec
        ns.engines.add(rec.engine_id)
        log.info("engine %d registered: model=%s tp=%d/%d page_bytes=%d", rec.engine_id,
                 namespace.model, namespace.tp_rank, namespace.tp_size, namespace.layout.page_bytes)
        return rec

    def engine(self, owner: object, engine_id: Any) -> EngineRecord:
        rec = self.engines.get(engine_id) if isinstance(engine_id, int) else None
        if rec is None or rec.owner is not owner:
            raise RpcError(Code.NOT_REGISTERED, f"engine {engine_id!r} is not registered on this connection")
        return rec

    # -- match / load / release -------------------------------------------
    def match(self, owner: object, engine_id: Any, keys: list[bytes]) -> Pin:
        return self.match_engine(self.engine(owner, engine_id), keys)

    def match_engine(self, rec: EngineRecord, keys: list[bytes]) -> Pin:
        """match() for an engine the caller looked up with engine() (the RPC handler does)."""
        # One call walks and locks (match_locked): the device segment on E's device, the
        # device and host segments in HOST, until release; no second walk up to the root.
        nodes, n_dev, n_host, device_pages, host_pages, locks = rec.ns.index.match_locked(keys, rec.engine_id)
        device_len, host_len = len(device_pages), len(host_pages)
        local = device_len + host_len
        if len(nodes) > n_dev + n_host:  # a disk segment
            disk_nodes = nodes[n_dev + n_host:]
            n_disk = disk_len = sum(len(x.keys) for x in disk_nodes)
            if not self.worth_loading("disk", rec, local, n_disk):
                disk_nodes, disk_len = [], 0
        else:
            disk_nodes, n_disk, disk_len = None, 0, 0
        pin = Pin(next(self._ids), rec, locks, device_len, host_len, disk_len,
                  nodes[n_dev + n_host - 1] if host_len else None, device_pages, host_pages)
        if disk_len < n_disk:
            pin.recompute_from = local
        self.pins[pin.pin_id] = pin
        if disk_nodes and self.on_match is not None:
            self.on_match(pin, disk_nodes)
        if self.admission is not None and rec.ns.lookups_feed_admission:
            self.admission.request_pages(keys, local + n_disk)
        c = self.counters
        c.matches += 1
        c.requested_pages += len(keys)
        if local or disk_len:
            matched = c.matched_pages
            matched["device"] += device_len
            matched["host"] += host_len
            matched["disk"] += disk_len  # a part left to be recomputed is no hit
        return pin

    def worth_loading(self, tier: str, rec: EngineRecord, start_pages: int, n_pages: int) -> bool:
        """Whether the engine should load a slow tier's part of its match rather than
        recompute it (fetch_or_recompute.py). Hybrid namespaces load everything: their
        usable prefix ends at a state checkpoint the KV must reach."""
        if not n_pages or self.fetch_cost is None or rec.ns.namespace.state is not None:
            return True
        return self.fetch_cost.worth_loading(tier, rec, start_pages, n_pages)

    def pin(self, owner: object, pin_id: Any) -> Pin:
        pin = self.pins.get(pin_id) if isinstance(pin_id, int) else None
        if pin is None or pin.engine.owner is not owner:
            raise RpcError(Code.NOT_FOUND, f"no match handle {pin_id!r} on this connection")
        return pin

    def take_prefetched(self, pin: Pin) -> None:
        """Fold what the disk prefetch brought to host into the pin's host part."""
        pf = pin.prefetch
        if pf is None or not pf.done or not pf.loaded_pages or pin.loaded:
            return
        pin.host_pages = np.concatenate([pin.host_pages, pf.host_pages[:pf.loaded_pages]])
        pin.host_len += pf.loaded_pages
        pin.disk_len -= pf.loaded_pages
        pin.host_node = pf.last_node
        pf.loaded_pages = 0

    def drop_disk_copy(self, ns: NamespaceState, node: TreeNode) -> None:
        """A page the index believed on disk is not readable: forget the disk copy
        (once no pin holds it; until then it is retried at each release)."""
        if node.removed or not node.on_disk:
            return
        try:
            ns.index.set_disk(node, False)
        except IndexStateError:
            self._stale_disk.append((ns, node))
            return
        self.reap(ns)

    def _retry_stale_disk(self) -> None:
        if self._stale_disk:
            stale, self._stale_disk = self._stale_disk, []
            for ns, node in stale:
                self.drop_disk_copy(ns, node)

    def _drop_device(self, rec: EngineRecord, nodes: list[TreeNode]) -> list[np.ndarray]:
        """Drop E's copies of these nodes (skipping any a request locked meanwhile)."""
        index = rec.ns.index
        mine: list[np.ndarray] = []
        for node in nodes:
            if node.removed or rec.engine_id not in node.device or node.lane_locked(rec.engine_id):
                continue
            if any(rec.engine_id in c.device for c in node.children.values()):
                continue  # no longer a leaf of E's device: a later evict takes it
            pages = index.clear_device(node, rec.engine_id)
            self.counters.evicted_pages["device"] += node.n_pages
            self.emit({"type": "removed", "tier": "device", "engine": rec.engine_id,
                       "namespace": rec.ns.salt.hex(), "keys": list(node.keys)})
            mine.append(pages)
        freed = index.take_freed()
        if freed:
            mine.extend(self._apply_freed(rec.ns, freed, rec))
        return mine

    def load_done(self, owner: object, pin_id: Any, device_pages: np.ndarray, reclaim: bool = False
                  ) -> np.ndarray:
        """Record E's copies of the host segment; returns pages E must free (it already had them).
        With `reclaim` (an engine that sent this without waiting for the answer) those pages
        are handed back by E's next evict instead, and none are returned."""
        pin = self.pin(owner, pin_id)
        rec = pin.engine
        if pin.loaded:
            raise RpcError(Code.BAD_PARAMS, f"match handle {pin_id} was already loaded")
        check_device_pages(rec, device_pages, pin.host_len)
        pin.loaded = True
        if pin.host_node is None:
            return EMPTY
        index = rec.ns.index
        start, end = pin.device_len, pin.device_len + pin.host_len
        # set_device covers the last host_len pages of the path ending at host_node, splitting
        # as needed, and returns the ones this engine already had (a concurrent load).
        dups = index.set_device(pin.host_node, rec.engine_id, device_pages.copy())
        # The request now holds the loaded pages on device: move the pin from host to device.
        index.lock(pin.host_node, Tier.DEVICE, rec.engine_id)
        pin.locks.append((pin.host_node, Tier.DEVICE, rec.engine_id))
        self._unlock_one(pin, pin.host_node, Tier.HOST, None)
        self.counters.loaded_pages += pin.host_len
        self.counters.bytes_host_to_device += pin.host_len * rec.ns.page_class.page_bytes
        self.emit_nodes("stored", Tier.DEVICE, rec, [n for n, p in path_with_offsets(pin.host_node)
                                                     if start <= p < end])
        if reclaim and len(dups):
            rec.reclaim.append(dups)
            return EMPTY
        return dups

    def _unlock_one(self, pin: Pin, node: TreeNode, tier: Tier, engine: int | None) -> None:
        pin.engine.ns.index.unlock(node, tier, engine)
        pin.locks.remove((node, tier, engine))
        self.reap(pin.engine.ns)

    def reap(self, ns: NamespaceState) -> None:
        """Unlocks and clears can remove nodes left in no tier; return what they held."""
        if ns.index.has_freed:  # after every release: most remove nothing
            self._apply_freed(ns, ns.index.take_freed(), None)

    def release(self, owner: object, pin_id: Any) -> None:
        self.drop_pin(self.pin(owner, pin_id))

    def drop_pin(self, pin: Pin) -> None:
        ns = pin.engine.ns
        freed = ns.index.unlock_held(pin.locks)  # whether removals wait to be reaped
        pin.locks.clear()
        self.pins.pop(pin.pin_id, None)
        if self.on_pin_dropped is not None and (pin.prefetch is not None or ns.namespace.state is not None):
            self.on_pin_dropped(pin)
            freed = True  # the hooks may unlock too
        if freed:
            self.reap(ns)
        if self._stale_disk:
            self._retry_stale_disk()

    # -- insert / backup ----------------------------------------------------
    def insert(self, owner: object, engine_id: Any, keys: list[bytes], tokens: np.ndarray,
               device_pages: np.ndarray, pin_id: Any = None) -> tuple[int, np.ndarray, PendingBackup | None]:
        """Record E's pages; with `pin_id` the request keeps them locked until it releases the pin."""
        rec = self.engine(owner, engine_id)
        pin = self.pin(owner, pin_id) if pin_id is not None else None
        if pin is not None and pin.engine is not rec:
            raise RpcError(Code.NOT_FOUND, f"match handle {pin_id} belongs to another engine")
        ns = rec.ns
        if len(tokens) != len(keys) * ns.index.page_size:
            raise RpcError(Code.BAD_PARAMS, f"{len(keys)} keys need {len(keys) * ns.index.page_size} tokens, "
                                            f"got {len(tokens)}")
        check_device_pages(rec, device_pages, len(keys))
        try:
            res = ns.index.insert(keys, tokens, engine=rec.engine_id, device_pages=device_pages)
        except ValueError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        self.counters.inserts += 1
        self.counters.inserted_pages += len(keys) - res.present_pages
        if self.admission is not None:
            self.admission.request_pages(keys, res.present_pages)
        if pin is not None and res.nodes:
            ns.index.lock(res.nodes[-1], Tier.DEVICE, rec.engine_id)
            pin.locks.append((res.nodes[-1], Tier.DEVICE, rec.engine_id))
        if res.new_nodes:
            self.emit_nodes("stored", Tier.DEVICE, rec, res.new_nodes)
        backup = None
        if self.write_policy is not WritePolicy.WRITE_BACK and res.nodes:
            need = [(n, p) for n, p in path_with_offsets(res.nodes[-1])
                    if n.host is None and rec.engine_id in n.device
                    and (self.write_policy is WritePolicy.WRITE_THROUGH or n.hit_count >= self.write_hit_threshold)]
            backup = self._plan_backup(rec, [(res.nodes[-1], need)], evict_after=False)
        return res.present_pages, res.dup_device_pages, backup

    def _plan_backup(self, rec: EngineRecord, parts: list[tuple[TreeNode, list[tuple[TreeNode, int]]]],
                     evict_after: bool) -> PendingBackup | None:
        backup = plan_backup(self.ingest, rec, parts, evict_after)
        if backup is None:
            if any(need for _, need in parts):
                self.counters.backups_skipped_no_space += 1
            return None
        self.counters.backups_planned += 1
        self.counters.backup_pages += len(backup.host_pages)
        return backup

    def backup_done(self, owner: object, backup_id: Any, ok: bool) -> np.ndarray:
        """The engine finished (or failed) a backup; returns device pages it may now free."""
        return self._finish_backup(self.ingest.lookup("backup", backup_id, owner=owner).data, ok)

    def _finish_backup(self, backup: PendingBackup, ok: bool) -> np.ndarray:
        rec = backup.engine
        freed: list[np.ndarray] = []

        def drop_device() -> None:  # write-back: the host copy is in place (or failed): E's device copy goes
            if backup.evict_after:
                for part in backup.parts:
                    freed.extend(self._drop_device(rec, [part.last_node]))

        if ok:
            self.ingest.commit(backup.res, place_backup, write_through=True, then=drop_device)
            self.counters.bytes_device_to_host += len(backup.host_pages) * rec.ns.page_class.page_bytes
        else:
            self.ingest.abort(backup.res, then=drop_device)
        return np.concatenate(freed) if freed else EMPTY

    # -- eviction -------------------------------------------------------------
    def evict_device(self, owner: object, engine_id: Any, num_pages: int
                     ) -> tuple[np.ndarray, PendingBackup | None]:
        """Free about num_pages of E's device pages: (free now, backup to run first)."""
        rec = self.engine(owner, engine_id)
        if not isinstance(num_pages, int) or num_pages < 0:
            raise RpcError(Code.BAD_PARAMS, "num_pages must be an int >= 0")
        index = rec.ns.index
        backup = None
        if self.write_policy is WritePolicy.WRITE_BACK:
            victims = index.select_victims(Tier.DEVICE, num_pages, rec.engine_id)
            unsaved = [v for v in victims if v.host is None and not v.on_disk]
            saved = [v for v in victims if v.host is not None or v.on_disk]
            backup = self._plan_backup(rec, [(v, [(v, path_with_offsets(v)[-1][1])]) for v in unsaved],
                                       evict_after=True)
            if backup is None:  # no host space: dropping them unsaved is all that is left
                saved = victims
            free_now = self._drop_device(rec, saved)
        else:
            free_now = self._apply_freed(rec.ns, index.evict(Tier.DEVICE, num_pages, rec.engine_id), rec)
        free_now.extend(rec.reclaim)
        rec.reclaim.clear()
        return (np.concatenate(free_now) if free_now else EMPTY), backup

    # -- connection loss ----------------------------------------------------
    def disconnect(self, owner: object) -> None:
        """Release everything a vanished connection held: pins, planned backups, engines."""
        for pin in [p for p in self.pins.values() if p.engine.owner is owner]:
            self.drop_pin(pin)
        for res in self.ingest.owned_by("backup", lambda e: e.owner is owner):
            self._finish_backup(res.data, ok=False)
        if self.hybrid is not None:
            self.hybrid.disconnect(owner)
        for rec in [r for r in self.engines.values() if r.owner is owner]:
            self.disconnect_engine(rec)

    def disconnect_engine(self, rec: EngineRecord) -> None:
        for pin in [p for p in self.pins.values() if p.engine is rec]:
            self.drop_pin(pin)
        for res in self.ingest.owned_by("backup", lambda e: e is rec):
            self._finish_backup(res.data, ok=False)
        del self.engines[rec.engine_id]
        rec.ns.engines.discard(rec.engine_id)
        self.ingest.engine_gone(rec)  # keyed stores it reserved (puts are the namespace's: leased)
        self._apply_freed(rec.ns, rec.ns.index.remove_engine(rec.engine_id), None)
        log.info("engine %d gone; its device residency is forgotten", rec.engine_id)
        self._forget_if_empty(rec.ns)

    def _forget_if_empty(self, ns: NamespaceState) -> None:
        """Drop a namespace that has no engine and holds nothing on any tier (its page
        class gives its slabs back): clients registering ever new namespaces must not grow
        the daemon without bound. A namespace with pages anywhere, or host pages in
        flight (a prefetch, a state backup), stays."""
        if ns.engines or ns.restoring or ns.page_class.used_pages or self.namespaces.get(ns.salt) is not ns:
            return
        if any(ns.index.num_pages(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK)):
            return
        if self.hybrid is not None and not self.hybrid.forget(ns):
            return
        del self.namespaces[ns.salt]
        self.host.forget_class(ns.page_class)
        log.debug("namespace %s forgotten: no engine, no pages", ns.salt.hex()[:12])

    # -- events -----------------------------------------------------------
    def emit_nodes(self, kind: str, tier: Tier, rec: EngineRecord | None, nodes: list[TreeNode],
                   ns: NamespaceState | None = None) -> None:
        ns = ns or (rec.ns if rec else None)
        keys = [k for n in nodes for k in n.keys]
        if keys and ns is not None:
            self.emit({"type": kind, "tier": TIER_NAMES[tier], "engine": rec.engine_id if rec else None,
                       "namespace": ns.salt.hex(), "keys": keys})

