"""Taking a host slab from one namespace so another can grow: the shared budget.

Slabs are owned by one namespace at a time (hicache/daemon/core/host_tier.py), so
when the arena has no free slab a namespace can only grow into memory another
one gives up whole. Evicting that namespace's LRU pages frees slots scattered
over its slabs, so the emptiest slab whose pages can all move is compacted
instead: its pages are copied into free slots of the namespace's other slabs
(in the daemon's own mapping: engines never copy between host slots) and the
index is told their new slot ids; the empty slab goes back to the tier.

A page can move only while nothing may be reading or writing it: its node is
not locked in HOST (no pin an engine loads from, no disk write in flight) and
its slot is in the index at all (slots of a pending backup or prefetch are
not, and keep their slab).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hicache.daemon.core.host_tier import HostTier, PageClass
from hicache.daemon.core.records import Counters, NamespaceState
from hicache.index.node import Tier, TreeNode

log = logging.getLogger(__name__)

MAX_ROUNDS = 64  # eviction rounds per reclaim; each frees at least one page


def reclaim_slab(host: HostTier, ns: NamespaceState, evict_host: Callable[[NamespaceState, int], bool],
                 counters: Counters) -> bool:
    """Give one of `ns`'s host slabs back to the tier, evicting its LRU pages as far as
    needed (`evict_host` is the engine cycle's, so the disk tier demotes them first); False
    when every slab of it holds pages that cannot move now."""
    cls = ns.page_class
    for _ in range(MAX_ROUNDS):
        if host.free_slabs:
            return True
        slab, nodes = _emptiest_movable_slab(ns, cls)
        if slab is None:
            return False
        used = cls.used_in(slab)
        room = cls.available() - cls.slabs[slab].available()
        if used <= room:
            _move_out(ns, cls, slab, nodes)
            cls.release_slab(slab)
            counters.slabs_reclaimed += 1
            return True
        if not evict_host(ns, used - room):
            return False
    return bool(host.free_slabs)


def _emptiest_movable_slab(ns: NamespaceState, cls: PageClass) -> tuple[int | None, list[TreeNode]]:
    """The slab of `cls` with the fewest pages, all of them movable, and the nodes holding them."""
    nodes = [n for n in ns.index.iter_nodes() if n.host is not None]
    slabs = np.fromiter(cls.slabs, dtype=np.int64, count=len(cls.slabs))
    movable = np.zeros(len(cls.tier.owner_of), dtype=np.int64)
    for node in nodes:
        if not node.lock_ref[Tier.HOST]:
            np.add.at(movable, cls.slab_of(node.host), 1)
    used = np.array([cls.used_in(int(s)) for s in slabs], dtype=np.int64)
    ok = movable[slabs] == used
    if not ok.any():
        return None, []
    slab = int(slabs[ok][np.argmin(used[ok])])
    return slab, [n for n in nodes if (cls.slab_of(n.host) == slab).any()]


def _move_out(ns: NamespaceState, cls: PageClass, slab: int, nodes: list[TreeNode]) -> None:
    """Move every page of `slab` into free slots of the class's other slabs."""
    alloc = cls.slabs.pop(slab)
    n = alloc.count - alloc.available()
    try:
        dst = cls.alloc(n, spare=False)  # the caller checked the other slabs have room: no new slab
        assert dst is not None
    finally:
        cls.slabs[slab] = alloc
    cls.used_pages -= n  # the moved pages were counted already
    arena, pb = cls.tier.arena.array, cls.page_bytes
    taken = 0
    for node in nodes:
        new = node.host.copy()
        at = np.flatnonzero(cls.slab_of(new) == slab)
        for j, d in zip(at, dst[taken:taken + len(at)]):
            s = int(new[j])
            arena[int(d) * pb:(int(d) + 1) * pb] = arena[s * pb:(s + 1) * pb]
            new[j] = d
        taken += len(at)
        old = ns.index.relocate_host(node, new)
        alloc.free(old[at])
    assert taken == n, "every page of the slab is in the index"
    log.debug("moved %d host pages of namespace %s out of slab %d", n, ns.salt.hex()[:12], slab)
