"""Keyed pages from the engine's side: the daemon's exists / fetch / store / store_done
(hicache/daemon/ingest/keyed.py) over a HiCacheClient, which brings the peer check,
the deadlines, the circuit breaker and the mapping of our namespace's slabs.

Every method answers "nothing" (0, None) when the daemon is away, hung or
refused the call; none raises for it. Page keys are 16-byte digests the caller
derives from its own page names (`named_page`), chained from the namespace
salt like every hicache key, so the daemon's disk rebuild verifies them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from hicache.client.client import HiCacheClient
from hicache.client.hints import RetainHint
from hicache.errors import DaemonUnavailable
from hicache.index.keys import KEY_BYTES, page_keys
from hicache.rpc.framing import bytes_to_ids

NAME_TOKENS = KEY_BYTES // 4  # a page name's digest, as int32 tokens


@dataclass(slots=True)
class Fetched:
    pin: int
    host_pages: np.ndarray  # host slot per key, -1 where the page is not stored
    epoch: int


@dataclass(slots=True)
class Reserved:
    store_id: int
    host_pages: np.ndarray  # host slot per key to copy into, -1 where the page is stored already
    epoch: int
    slabs: int  # the namespace's slab version when reserved (spares to map once copied)


def named_page(salt: bytes, name: bytes, page_size: int) -> tuple[bytes, np.ndarray]:
    """(page key, page tokens) for a page the engine names itself. The tokens carry a
    16-byte digest of the name (then zeros), so two names share a key only if their
    digests collide (as likely as any two hicache keys colliding)."""
    if page_size < NAME_TOKENS:
        raise ValueError(f"a named page needs page_size >= {NAME_TOKENS} (its name travels in its tokens), "
                         f"got {page_size}")
    tokens = np.zeros(page_size, dtype="<i4")
    digest = hashlib.blake2b(name, digest_size=KEY_BYTES, person=b"hicache-named").digest()
    tokens[:NAME_TOKENS] = np.frombuffer(digest, dtype="<i4")
    return page_keys(salt, tokens, page_size)[0], tokens


class KeyedPagesClient:
    """Not thread-safe (nor is HiCacheClient): one per thread."""

    def __init__(self, client: HiCacheClient) -> None:
        self.client = client

    def _call(self, method: str, params: dict, timeout_s: float, *, map_slabs: bool = True) -> dict | None:
        c = self.client
        c.poll()  # adopt a connection the background probe made
        if c.engine_id is None:
            return None
        try:
            return c._call(method, {"engine": c.engine_id, **params}, timeout_s, map_slabs=map_slabs)
        except DaemonUnavailable:
            return None

    def exists(self, keys: list[bytes]) -> int:
        """How many leading keys the daemon stores (host or disk); 0 when it is away."""
        if not keys:
            return 0
        r = self._call("exists", {"keys": b"".join(keys)}, self.client.deadlines.match_s)
        return 0 if r is None else int(r["present"])

    def fetch(self, keys: list[bytes]) -> Fetched | None:
        """Pin the stored pages of `keys` on host (disk pages are read first). Copy from
        the slots, then `release`. None when the daemon is away."""
        r = self._call("fetch", {"keys": b"".join(keys)}, self.client.deadlines.load_s)
        if r is None:
            return None
        return Fetched(int(r["pin"]), bytes_to_ids(r["host_pages"]), self.client.epoch)

    def release(self, fetched: Fetched) -> None:
        if fetched.epoch == self.client.epoch:  # a new daemon never issued this pin
            self._call("release", {"pin": fetched.pin}, self.client.deadlines.update_s)

    def store(self, keys: list[bytes], tokens: np.ndarray, parent: bytes | None = None) -> Reserved | None:
        """Host slots to copy the pages of `keys` into; None when the daemon is away or
        its host tier has no room. Report the copies with `store_done`. `keys` are one
        prefix's consecutive pages and `parent` (when known) the page just before them:
        the daemon keeps them as a chain, so eviction takes a prompt's tail first."""
        # load_s, like fetch: making room may evict, or take a slab from another namespace and
        # move its pages, which takes the daemon longer than a plain update
        params = {"keys": b"".join(keys), "tokens": np.ascontiguousarray(tokens, "<i4").tobytes()}
        if parent is not None:
            params["parent"] = parent
        # The reply's slab version may also name spare slabs the daemon keeps for our next
        # store (hicache/daemon/core/host_tier.py): slabs these pages need are mapped now,
        # the rest after the copy (store_done), so their pre-fault does not compete with it.
        r = self._call("store", params, self.client.deadlines.load_s, map_slabs=False)
        if r is None:
            return None
        if r["store"] is None:
            self.client._check_slabs(r)
            return None
        got = Reserved(int(r["store"]), bytes_to_ids(r["host_pages"]), self.client.epoch, int(r["slabs"]))
        arena, under = self.client.arena, r.get("page_slabs")
        if arena is None or under is None or any(not 0 <= s < arena.num_slabs or arena.slab_gen(s) != g
                                                 for s, g in under):
            self.client._check_slabs(r)
        return got

    def store_done(self, reserved: Reserved, ok: bool = True) -> int | None:
        """The pages are in their slots (or the copy failed): they become visible to every
        engine of the namespace. Returns how many were new; None when the daemon is away."""
        if reserved.epoch != self.client.epoch:
            return None
        r = self._call("store_done", {"store": reserved.store_id, "ok": ok}, self.client.deadlines.update_s)
        if r is None:
            return None
        self.client._check_slabs({"slabs": reserved.slabs})  # the spares for the next store
        return int(r["stored"])

    def pin(self, keys: list[bytes], hint: RetainHint) -> dict | None:
        """Keep the chain ending at keys[-1] (SGLang: the page names' keys, `named_page`) per
        `hint` (a pin, or a priority only); None when the daemon is away or refused (logged)."""
        method = "pin" if hint.pins else "prioritize"
        return self._call(method, {"keys": b"".join(keys), **hint.params()}, self.client.deadlines.update_s)

    def mapped(self, host_pages: np.ndarray) -> bool:
        """Whether every slot lies in a slab mapped here (never touch one that does not)."""
        arena = self.client.arena
        used = host_pages[host_pages >= 0]
        return arena is not None and (not len(used) or arena.covers(used, self.client.layout.page_bytes))


__all__ = ["Fetched", "KeyedPagesClient", "Reserved", "named_page"]
