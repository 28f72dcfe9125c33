"""The host slabs of the engine's namespace, mapped in its process.

The daemon's arena is reserved here as address space at connect (HostArena.reserve);
only the slabs holding our namespace's pages are backed, by memfds the daemon passes
with `map_slabs` answers (SCM_RIGHTS). A reply naming a newer slab version than the one
mapped makes the client map the new ones (`_check_slabs`); a client that never touches
host pages itself (the vLLM scheduler: `map_arena` False) only records the version.
Host pages in a slab that could not be mapped are never touched (`arena.covers`).

SlabCalls is mixed into HiCacheClient (hicache/client/client.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.client.connection import RpcConnection, _close_fd
from hicache.errors import ClientError, DaemonSlow, DaemonUnavailable, HiCacheError

if TYPE_CHECKING:
    from hicache.client.deadlines import CallDeadlines
    from hicache.tiers.host.arena import HostArena

log = logging.getLogger(__name__)

SLAB_SYNC_TRIES = 3  # map_slabs answers BUSY while replies (events) are unread; reading them clears it


class SlabCalls:
    """HiCacheClient's slab mapping (see the module docstring)."""

    if TYPE_CHECKING:  # HiCacheClient's
        arena: HostArena | None
        conn: RpcConnection | None
        engine_id: int | None
        deadlines: CallDeadlines
        slab_version: int
        map_arena: bool

        def _late(self, method: str, e: DaemonSlow, count: int = 1, ends: bool = True) -> None: ...
        def _open(self, why: str) -> None: ...

    def _check_slabs(self, reply: Any) -> None:
        """Map the slabs our namespace gained, when a reply says the daemon's are newer."""
        if type(reply) is dict and reply.get("slabs", self.slab_version) != self.slab_version:
            if self.map_arena:
                self.sync_slabs()
            else:
                self.slab_version = max(self.slab_version, int(reply["slabs"]))

    def sync_slabs(self) -> bool:
        """Map every slab the daemon holds our namespace's pages in (fds for those we lack
        come with the answer) and drop those it no longer does. False when it failed: host
        pages in unmapped slabs are then not copied (`arena.covers`), never touched."""
        arena, conn = self.arena, self.conn
        if arena is None or conn is None:
            return False
        for _ in range(SLAB_SYNC_TRIES):
            have = [[s, arena.slab_gen(s)] for s in np.flatnonzero(arena.backed).tolist()]
            fds: list[int] = []
            try:
                r = conn.call("map_slabs", {"engine": self.engine_id, "have": have},
                              self.deadlines.update_s, fds=fds)
                if len(fds) != len(r["sent"]):
                    raise ClientError("BAD_REPLY", f"{len(fds)} slab fds for {len(r['sent'])} slabs")
                for (slab, gen), fd in zip(r["sent"], fds):
                    arena.map_slab(int(slab), fd, int(gen), prefault=False)  # takes the fd, even when it fails
                fds = []
                for slab, _ in r["sent"]:  # once all are mapped: an mmap waits for a pre-fault in progress
                    arena.prefault_async(int(slab))
                owned = {int(s) for s, _ in r["owned"]}
                for slab in np.flatnonzero(arena.backed).tolist():
                    if slab not in owned:
                        arena.unmap_slab(slab)
            except DaemonSlow as e:  # slabs unmapped: their pages are not touched (a miss, a skip)
                for fd in fds:
                    _close_fd(fd)
                self._late("map_slabs", e)
                return False
            except DaemonUnavailable as e:
                self._open(e.message)
                return False
            except (ClientError, HiCacheError, OSError) as e:
                for fd in fds:
                    _close_fd(fd)
                if isinstance(e, ClientError) and e.code == "BUSY":  # events were unread: they are now
                    continue
                log.warning("could not map the host slabs of our namespace: %s", e)
                return False
            self.slab_version = int(r["version"])
            return True
        log.warning("could not map the host slabs of our namespace: the daemon stayed busy")
        return False
