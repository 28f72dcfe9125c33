"""Which pages the remote tier takes: the disk's admission (hicache/index/admission.py),
with the store's room as its adaptive switch.

A record written to the shared store costs the store's memory and the network, and in a
full store it pushes out a record some daemon would have hit. So once the store is full,
a page is written (through, or published from disk) only when the admission expects it
back: seen at least twice, or new in a conversation's next turn -- the sketch the disk
tier's admission keeps, fed by every request. While the store has room every page is
written, as before admission: a write then costs no hit, and a page first computed here
is what other daemons may reuse, which this daemon's history cannot predict.

Room is the store's to say (RemoteStore.has_room: for Redis, no master above 90% of its
`maxmemory`; a store that cannot say has room). It is asked on the remote worker at most
every ROOM_CHECK_S, when a write or `stats` wants it, never on the write path itself:
the last answer decides. `remote_admission = "all"` writes every page.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from hicache.index.admission import DiskAdmission, admission_key
from hicache.index.radix import TreeNode

ROOM_CHECK_S = 1.0
REMOTE_ADMISSION = ("all", "reuse")


class RemoteAdmission:
    def __init__(self, mode: str, mover: Any, admission: DiskAdmission | None) -> None:
        if mode not in REMOTE_ADMISSION:
            raise ValueError(f"remote admission must be one of {REMOTE_ADMISSION}, got {mode!r}")
        self.mode = mode
        self.mover = mover  # RemoteMover: its store, worker and loop
        self.admission = admission  # the sketch every request feeds (None: no filter)
        self.room = True  # the store's last answer; unknown counts as room
        self.admitted_pages = 0
        self.rejected_pages = 0
        self._checked = -float("inf")
        self._check: concurrent.futures.Future | None = None

    def admit(self, node: TreeNode) -> bool:
        """Whether the node's pages go to the store; counted."""
        self.refresh()
        ok = (self.mode == "all" or self.admission is None or self.room
              or self.admission.predicts_reuse(admission_key(node.keys[0])))  # the head speaks for the run
        if ok:
            self.admitted_pages += node.n_pages
        else:
            self.rejected_pages += node.n_pages
        return ok

    def refresh(self) -> None:
        """Ask the store for its room again, when the last answer is older than ROOM_CHECK_S."""
        if self.mode == "all" or self._check is not None or time.monotonic() - self._checked < ROOM_CHECK_S:
            return
        if not self.mover.worker.available:
            return
        self._checked = time.monotonic()
        self._check = fut = self.mover.worker.submit(self.mover.store.has_room())
        fut.add_done_callback(lambda f: self.mover.loop.call_soon_threadsafe(self._answered, f))

    def _answered(self, fut: concurrent.futures.Future) -> None:
        self._check = None
        if fut.cancelled() or fut.exception() is not None:  # no answer: the last one stands
            return
        room = fut.result()
        self.room = room is not False

    def stats(self) -> dict[str, Any]:
        self.refresh()
        return {"admission": {"mode": self.mode, "room": self.room, "admitted_pages": self.admitted_pages,
                              "rejected_pages": self.rejected_pages}}
