"""HybridEngineCache: EngineCache plus the recurrent state of a hybrid model.

A hybrid request can reuse a cached prefix only up to a state checkpoint (see
hicache/index/checkpoints.py). The daemon cuts the KV match there and names
the checkpoint's host state slot; `lookup` copies it into a private slot of the
engine's StatePool (copy on write: the request's next token overwrites it) and
starts the KV load as EngineCache does. While it prefills, the engine snapshots
its state at `checkpoint_positions` into spare slots; `store` offers them with
the KV and copies those the daemon keeps into the host state slots it names.

One request at a time per HybridPrefix, like EngineCache's Prefix:
    hp = cache.lookup(tokens)                    # hp.length tokens reusable; hp.state_slot restored
    ... forward tokens[hp.length:] from hp.state_slot, snapshotting at cache.checkpoint_positions(hp, n)
    cache.finish_load(hp)
    cache.store(hp, tokens, new_pages, {position: snapshot slot, ...})
    cache.release(hp)                            # frees hp.state_slot
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.client.client import HiCacheClient
from hicache.client.engine_cache import EngineCache, Prefix
from hicache.errors import ClientError
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.device.state_pool import StatePool

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class HybridPrefix:
    kv: Prefix
    state_slot: int        # private device state slot: the restored checkpoint, or zeros
    length: int            # reusable tokens: KV pages and state both cover them
    fork_at: int | None    # where the request leaves the cached tree inside a node
    page_size: int

    @property
    def device_pages(self) -> np.ndarray:
        """The device pages holding the first `length` tokens' KV."""
        return self.kv.device_pages[:self.length // self.page_size]

    def wait_layer(self, layer_id: int) -> None:
        self.kv.wait_layer(layer_id)


class HybridEngineCache:
    def __init__(self, client: HiCacheClient, device_pool: DevicePool, allocator: Any, states: StatePool) -> None:
        if client.namespace.state is None or client.namespace.state != states.layout:
            raise ClientError("BAD_NAMESPACE", "the client must be registered with the state pool's StateLayout")
        self.states = states
        self.layout = states.layout
        self.kv = EngineCache(client, device_pool, allocator)
        self.client = client
        self.page_size = device_pool.page_size

    def lookup(self, tokens: Any) -> HybridPrefix | None:
        """The reusable prefix of `tokens` with its state restored into a private slot;
        None when the state pool has no free slot (nothing taken)."""
        got = self.states.alloc(1)
        if got is None:
            return None
        prefix = self.kv.lookup(tokens)
        sm = prefix.match.state
        length = 0
        arena = self.kv.arena
        # A checkpoint at the very end is no use: the last token's logits need that token computed.
        nbytes = self.layout.checkpoint_bytes
        if (sm is not None and 0 < sm.length < len(tokens) and sm.host_slot is not None and arena is not None
                and prefix.epoch == self.client.epoch and self.client.connected
                and len(prefix.device_pages) * self.page_size >= sm.length
                and arena.covers(np.array([sm.host_slot]), nbytes)):
            # the daemon keeps the checkpoint locked until release, or until it sees the
            # connection close (hence `connected`): its slot is stable now
            self.states.read_from(arena.array[sm.host_slot * nbytes:(sm.host_slot + 1) * nbytes], got[0])
            length = sm.length
        return HybridPrefix(prefix, got[0], length, None if sm is None else sm.fork_at, self.page_size)

    def checkpoint_positions(self, hp: HybridPrefix, num_tokens: int) -> list[int]:
        """Where to snapshot the state while computing tokens hp.length..num_tokens: at the
        fork the daemon named and at the sequence's last chunk boundary within full pages
        (what the daemon's store rule keeps; see hicache/index/checkpoints.py)."""
        full = num_tokens - num_tokens % self.page_size
        out = {self.layout.aligned(full)}
        if hp.fork_at is not None:
            out.add(self.layout.aligned(min(hp.fork_at, full)))
        return sorted(p for p in out if hp.length < p <= full)

    def finish_load(self, hp: HybridPrefix) -> None:
        self.kv.finish_load(hp.kv)

    def store(self, hp: HybridPrefix, tokens: Any, new_pages: np.ndarray, checkpoints: dict[int, int]) -> int:
        """Offer the KV (the first hp.length tokens' pages, then `new_pages`) and the state
        snapshots in `checkpoints` (position -> device state slot); copy the ones the daemon
        keeps to host. Returns how many checkpoints the daemon stored."""
        # KV the request did not reuse (beyond its checkpoint) was recomputed into new_pages
        hp.kv.device_pages = hp.device_pages
        reply = self.kv.store(hp.kv, tokens, new_pages, states=checkpoints or None)
        plan = None if reply is None else reply.state_backup
        if plan is None:
            return 0
        arena = self.kv.arena
        nbytes = self.layout.checkpoint_bytes
        ok = (arena is not None and self.client.connected  # a dropped connection's slots are freed
              and arena.covers(np.asarray(plan.host_slots, dtype=np.int64), nbytes))
        if ok:
            try:
                for host_slot, dev_slot in zip(plan.host_slots, plan.device_slots):
                    self.states.write_to(dev_slot, arena.array[host_slot * nbytes:(host_slot + 1) * nbytes])
            except Exception:
                log.exception("state backup %d failed", plan.backup_id)
                ok = False
        return self.client.state_backup_done(plan, ok) or 0

    def release(self, hp: HybridPrefix) -> None:
        self.kv.release(hp.kv)
        self.states.free([hp.state_slot])

    def close(self) -> None:
        self.kv.close()
