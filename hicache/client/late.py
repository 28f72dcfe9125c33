"""What a late answer leaves behind, and how the client gives it back.

A call the engine gave up on at its deadline (DaemonSlow) is still handled by the
daemon, which may grant something in its answer: a match pins pages, a put or a keyed
store reserves host pages, a keyed fetch pins them. The engine treated the call as a
miss or a skip, so nothing will ever report on what was granted; the connection hands
the answer, when it comes, to the handler named here, and posts the calls it returns
(hicache/client/connection.py), in order, before any later call can be answered.

Calls that move the engine's own device pages (insert, evict, a waited backup_done or
load_done) cannot be undone this way: the engine may already have reused pages the
daemon would then think it holds. An insert whose caller takes its late answer
(EngineCache: it keeps the offered pages "in doubt" until the answer says whether the
daemon took them) keeps the connection; for the others a late answer ends it
(ENDS_ON_LATE): the daemon forgets the engine's device residency when it sees the
close, and the client reconnects, as for a dead daemon. Calls the daemon holds on purpose (HELD: a
`load` waiting for the disk or the remote store) may come late without the connection
turning suspect.
"""

from __future__ import annotations

from typing import Any

from hicache.client.ledger import LateHandler

# calls whose late answer leaves the engine and the daemon disagreeing on device pages
ENDS_ON_LATE = frozenset({"insert", "evict", "backup_done", "load_done", "state_backup_done"})
# calls the daemon may rightly hold (a disk read, a remote lookup or fetch): their lateness
# says nothing of the daemon's health, so it sends no liveness probe
HELD = frozenset({"load", "fetch"})


def _release_pin(outcome: Any) -> list[tuple[str, dict]] | None:
    """A match's or a keyed fetch's pin, released."""
    if type(outcome) is dict and type(outcome.get("pin")) is int:
        return [("release", {"pin": outcome["pin"]})]
    return None


def undo_late(method: str, engine_id: int | None) -> LateHandler | None:
    """The handler for a late answer to `method` (None: nothing to give back)."""
    if method in ("match", "fetch"):
        return _release_pin
    if method == "put":
        def give_back_put(outcome: Any) -> list[tuple[str, dict]] | None:
            if type(outcome) is dict and outcome.get("put") is not None:
                return [("put_done", {"engine": engine_id, "put": outcome["put"], "ok": False})]
            return None
        return give_back_put
    if method == "store":
        def give_back_store(outcome: Any) -> list[tuple[str, dict]] | None:
            if type(outcome) is dict and outcome.get("store") is not None:
                return [("store_done", {"engine": engine_id, "store": outcome["store"], "ok": False})]
            return None
        return give_back_store
    return None
