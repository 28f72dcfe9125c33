"""KV cache events for routers: the blocks hicache holds for this vLLM, in vLLM's own events.

Cache-aware routers (llm-d, Dynamo) read vLLM's KV event stream (`--kv-events-config`):
`BlockStored` / `BlockRemoved` carrying vLLM's block hashes and a `medium`. vLLM reports
its device blocks (GPU); the connector reports the same blocks while hicache holds them:
medium CPU on the daemon's host tier, STORAGE on its disk tier, locality LOCAL (the
node's own daemon), through `take_events`, so vLLM's publisher sends them.

The daemon publishes `stored` / `removed` per tier with hicache's page keys. A thread
keeps its own connection (hello, register the namespaces, so a non-admin peer may see
them, subscribe) and queues what arrives; the scheduler translates the queue once per
step in `take_events` (a lock and a swap when nothing came). A daemon that is away
costs the step nothing: only the thread waits, retrying with backoff.

Page keys are hicache's, so the scheduler side maps the pages it puts or matches to
vLLM's block hash, parent, token ids and LoRA, in an LRU map of at most `max_blocks`
blocks. What is announced:
- a block, on a tier, while every namespace rank holds its page there (TP: each rank
  stores its own shard);
- blocks this vLLM puts: as the daemon's events say (host once the put is done, disk
  once committed), and removed as they say;
- blocks the daemon already held (another vLLM of the namespace stored them, or this
  vLLM restarted): once a request here finds them on host (its match, or a put that
  finds them present), since only then is their vLLM hash known; then as events say.
  Blocks no request here touches are left to the vLLM that stored them.
- a block leaving the map (LRU) is announced removed, and when the subscription is lost
  (daemon restart, a backlog drop, the queue overflowing) every announced block is:
  the stream may miss a block hicache holds, never claim one it dropped.
A reply's facts are applied when the reply comes; events taken later are newer or
superseded by a newer one (the daemon answers and publishes from one loop), so the
announced state converges to the daemon's.

vLLM publishes at its steps: events queued when it checks for work keep it stepping
(`has_pending_push_work`); events that arrive while it is idle wait for its next
request. The remote tier is not reported: the daemon keeps no record of what the store
holds or evicts, so no removal could ever follow a stored event.
"""

from __future__ import annotations

import array
import logging
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm import envs
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, resolve_block_hashes, to_event_extra_keys

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.errors import HiCacheError

log = logging.getLogger(__name__)

TIERS = {"host": 0, "disk": 1}  # daemon tier -> index in _Block.held; device is vLLM's own (GPU)
MEDIUMS = (MEDIUM_CPU, MEDIUM_STORAGE)
LOCALITY = "LOCAL"
MAX_QUEUED_EVENTS = 16384  # daemon events waiting for the next step; past it: resync
READ_TIMEOUT_S = 365 * 86400.0  # the reader waits for events indefinitely; close() wakes it
BACKOFF_S = (0.05, 2.0)
INT_HASH_MASK = (1 << 64) - 1
_RESYNC = object()  # queued when the subscription (re)starts: what came before is unknown


@dataclass(slots=True, eq=False)
class _Block:
    """One vLLM block hicache may hold, one page per namespace rank."""

    block_hash: int | bytes
    parent_hash: int | bytes | None
    tokens: array.array
    extra_keys: tuple[Any, ...] | None
    lora: tuple[int | None, str | None]
    keys: list[bytes | None]  # page key per namespace rank
    held: list[int]  # per tier: bitmask of the ranks holding it
    announced: int = 0  # bitmask of tiers announced stored


class EventSubscription:
    """The daemon's event stream on its own connection, read by a thread into a bounded queue."""

    def __init__(self, clients: Sequence[HiCacheClient]) -> None:
        self.clients = list(clients)
        self.socket_path = self.clients[0].socket_path
        self.daemon_uids = self.clients[0].daemon_uids
        self.namespaces = frozenset(c.salt.hex() for c in self.clients)
        self._lock = threading.Lock()
        self._queue: deque[Any] = deque()
        self._overflowed = False
        self._stop = threading.Event()
        self._conn: RpcConnection | None = None
        self._thread = threading.Thread(target=self._run, name="hicache-events", daemon=True)
        self._thread.start()

    def take(self) -> list[Any]:
        """What arrived since the last call, oldest first; `_RESYNC` where events were lost."""
        with self._lock:
            if not self._queue and not self._overflowed:
                return []
            out, self._queue = list(self._queue), deque()
            if self._overflowed:  # the queue was cleared where events were lost: the resync goes first
                self._overflowed = False
                out.insert(0, _RESYNC)
        return out

    @property
    def pending(self) -> bool:
        return bool(self._queue) or self._overflowed

    def _put(self, item: Any) -> None:
        with self._lock:
            if len(self._queue) >= MAX_QUEUED_EVENTS:
                self._overflowed = True  # the consumer resyncs: dropping silently would lie
                self._queue.clear()
            else:
                self._queue.append(item)

    def _subscribe(self) -> RpcConnection:
        conn = RpcConnection.connect(self.socket_path, 5.0, self.daemon_uids)
        try:
            conn.hello()
            for c in self.clients:  # registering lets a non-admin peer see the namespace's events
                ns = c.namespace
                conn.call("register", {"model": ns.model, "layout": c.layout.to_dict(), "tp_rank": ns.tp_rank,
                                       "tp_size": ns.tp_size, "extra_key": ns.extra_key, "device_pages": 1})
            conn.call("subscribe")
        except BaseException:
            conn.close()
            raise
        conn.timeout_s = READ_TIMEOUT_S
        return conn

    def _run(self) -> None:
        backoff = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                conn = self._subscribe()
            except HiCacheError as e:
                log.debug("event subscription: %s; retrying in %.2f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            backoff = BACKOFF_S[0]
            self._conn = conn
            self._put(_RESYNC)
            log.info("hicache: subscribed to the daemon's KV events")
            try:
                while not self._stop.is_set():
                    ev = conn.read_event()
                    if isinstance(ev, dict) and ev.get("namespace") in self.namespaces:  # admins see all
                        self._put(ev)
            except HiCacheError as e:
                if not self._stop.is_set():
                    log.warning("hicache: KV event subscription lost (%s); resubscribing", e)
            finally:
                conn.close()
                self._conn = None

    def close(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's blocking recv
            except OSError:
                pass
        self._thread.join(timeout=5.0)


class KVEventBridge:
    """Maps hicache page keys to vLLM blocks and turns the daemon's events into vLLM's.

    All methods but the subscription's thread run on vLLM's scheduler thread."""

    def __init__(self, clients: dict[int, HiCacheClient], page_size: int, hash_block_size: int, *,
                 max_blocks: int = 65536, spec_kind: str | None = None) -> None:
        if max_blocks < 1:
            raise ValueError(f"kv_events_max_blocks must be at least 1, got {max_blocks}")
        self.page_size = page_size
        self.hash_block_size = hash_block_size
        self.max_blocks = max_blocks
        self.spec_kind = spec_kind
        self.ranks = len(clients)
        self.full_mask = (1 << self.ranks) - 1
        self.rank_of_ns = {c.salt.hex(): r for r, c in clients.items()}
        self.blocks: OrderedDict[int | bytes, _Block] = OrderedDict()  # by vLLM hash, least recent first
        self.by_key: dict[bytes, tuple[_Block, int]] = {}  # page key -> (block, rank)
        self.out: list[KVCacheEvent] = []  # translated, for the next take_events
        self.resyncs = 0
        self.int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self.sub = EventSubscription([clients[r] for r in sorted(clients)])

    # -- facts from the scheduler's own calls ------------------------------------------------
    def note_put(self, rank: int, request: Any, keys: list[bytes], present: int, start: int = 0) -> None:
        """A put of the request's first len(keys) pages: the first `present` are on host now.
        Pages before `start` were noted by an earlier put of the request (a decode step's
        put repeats the whole prefix; noting it again would cost more than the put)."""
        self._note(rank, request, keys, present, start)

    def note_match(self, rank: int, request: Any, keys: list[bytes], host_len: int) -> None:
        """A match: the first `host_len` pages are on host now; the rest may come (events say)."""
        self._note(rank, request, keys, host_len, 0)

    def _external(self, block_hash: bytes) -> int | bytes:
        """vLLM's maybe_convert_block_hash, its environment flag read once instead of per block."""
        return int.from_bytes(block_hash, "big") & INT_HASH_MASK if self.int_hashes else block_hash

    def _note(self, rank: int, request: Any, keys: list[bytes], on_host: int, start: int) -> None:
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, self.page_size)
        n = min(len(keys), len(hashes))
        if start >= n:
            return
        stored: list[_Block] = []
        blocks, by_key = self.blocks, self.by_key
        parent = self._external(hashes[start - 1]) if start else None
        for i in range(start, n):
            h = self._external(hashes[i])
            blk = blocks.get(h)
            if blk is None:
                blk = self._new_block(request, i, h, parent)
            else:
                blocks.move_to_end(h)
            parent = h
            key = keys[i]
            if blk.keys[rank] != key:
                old = blk.keys[rank]
                if old is not None:
                    by_key.pop(old, None)
                blk.keys[rank] = key
                by_key[key] = (blk, rank)
            if i < on_host and self._hold(blk, 0, rank, True):
                stored.append(blk)
        if stored:
            self._emit_stored(stored, 0)
        self._trim()

    def _new_block(self, request: Any, i: int, h: int | bytes, parent: int | bytes | None) -> _Block:
        ps = self.page_size
        start, end = i * ps, (i + 1) * ps
        lora = request.lora_request
        extra = None
        if lora is not None or getattr(request, "cache_salt", None) or getattr(request, "mm_features", None):
            extra = generate_block_hash_extra_keys(request, start, end, 0)[0]
        blk = _Block(h, parent, array.array("l", request.all_token_ids[start:end]), extra,
                     (lora.adapter_id, lora.name) if lora is not None else (None, None),
                     [None] * self.ranks, [0] * len(TIERS))
        self.blocks[h] = blk
        return blk

    def _trim(self) -> None:
        """Past max_blocks, the least recent blocks leave the map, announced removed first."""
        gone: list[list[_Block]] = [[] for _ in TIERS]
        while len(self.blocks) > self.max_blocks:
            _, blk = self.blocks.popitem(last=False)
            for key in blk.keys:
                if key is not None:
                    self.by_key.pop(key, None)
            for t in range(len(TIERS)):
                if blk.announced >> t & 1:
                    gone[t].append(blk)
        for t, blks in enumerate(gone):
            if blks:
                self.out.append(self._removed([b.block_hash for b in blks], t))

    def _hold(self, blk: _Block, tier: int, rank: int, on: bool) -> bool:
        """Set or clear one rank's page on a tier; True when the block's announcement flips."""
        blk.held[tier] = blk.held[tier] | (1 << rank) if on else blk.held[tier] & ~(1 << rank)
        full = blk.held[tier] == self.full_mask
        was = bool(blk.announced >> tier & 1)
        if full == was:
            return False
        blk.announced ^= 1 << tier
        return True

    # -- the daemon's events -----------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's events for what the daemon reported since the last step."""
        for ev in self.sub.take():
            if ev is _RESYNC:
                self._resync()
            else:
                self._translate(ev)
        out, self.out = self.out, []
        return out

    @property
    def pending(self) -> bool:
        return self.sub.pending or bool(self.out)

    def _translate(self, ev: dict) -> None:
        tier = TIERS.get(ev.get("tier", ""))
        rank = self.rank_of_ns.get(ev.get("namespace", ""))
        kind = ev.get("type")
        if tier is None or rank is None or kind not in ("stored", "removed"):
            return
        on = kind == "stored"
        flipped = []
        for key in ev.get("keys", ()):
            hit = self.by_key.get(key)
            if hit is not None and hit[1] == rank and self._hold(hit[0], tier, rank, on):
                flipped.append(hit[0])
        if not flipped:
            return
        if on:
            self._emit_stored(flipped, tier)
        else:
            self.out.append(self._removed([b.block_hash for b in flipped], tier))

    def _resync(self) -> None:
        """Events were lost: nothing is known held any more; what was announced is removed."""
        gone: list[list[int | bytes]] = [[] for _ in TIERS]
        for blk in self.blocks.values():
            for t in range(len(TIERS)):
                if blk.announced >> t & 1:
                    gone[t].append(blk.block_hash)
            blk.announced = 0
            blk.held = [0] * len(TIERS)
        for t, hashes in enumerate(gone):
            if hashes:
                self.out.append(self._removed(hashes, t))
        self.resyncs += 1

    # -- vLLM's events ----------------------------------------------------------------------
    def _emit_stored(self, blocks: Iterable[_Block], tier: int) -> None:
        """One BlockStored per run of chained blocks (each the previous one's child)."""
        run: list[_Block] = []
        for blk in blocks:
            if run and (blk.parent_hash != run[-1].block_hash or blk.lora != run[-1].lora):
                self.out.append(self._stored(run, tier))
                run = []
            run.append(blk)
        if run:
            self.out.append(self._stored(run, tier))

    def _stored(self, run: list[_Block], tier: int) -> BlockStored:
        tokens: list[int] = []
        for blk in run:
            tokens.extend(blk.tokens)
        extra = None
        if any(b.extra_keys is not None for b in run):
            extra = to_event_extra_keys([b.extra_keys for b in run])
        return BlockStored(block_hashes=[b.block_hash for b in run], parent_block_hash=run[0].parent_hash,
                           token_ids=tokens, block_size=self.page_size, lora_id=run[0].lora[0],
                           medium=MEDIUMS[tier], lora_name=run[0].lora[1], extra_keys=extra, group_idx=0,
                           kv_cache_spec_kind=self.spec_kind, locality=LOCALITY)

    def _removed(self, hashes: list[int | bytes], tier: int) -> BlockRemoved:
        return BlockRemoved(block_hashes=hashes, medium=MEDIUMS[tier], group_idx=0, locality=LOCALITY)

    def close(self) -> None:
        self.sub.close()


def bridge_for(vllm_config: Any, kv_cache_config: Any, clients: dict[int, HiCacheClient], page_size: int,
               max_blocks: int) -> KVEventBridge | None:
    """The bridge when vLLM publishes KV events (`kv_events_config.enable_kv_cache_events`), else None."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    spec_kind = None
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        spec_kind = get_kv_cache_spec_kind(kv_cache_config.kv_cache_groups[0].kv_cache_spec).value
    except (AttributeError, IndexError, ImportError):  # older vLLM, or no group: leave it unspecified
        pass
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or page_size
    log.info("hicache: reporting host and disk blocks in vLLM's KV events (map of at most %d blocks)", max_blocks)
    return KVEventBridge(clients, page_size, hash_block_size, max_blocks=max_blocks, spec_kind=spec_kind)
