"""The engine cycle's calls: look a prefix up (`match`, `refresh` for its disk part),
store pages (`insert` with device residency, or `put` for an engine that keeps its own
device cache), and give device pages back (`evict`). Each is one waited call with the
deadline of its kind; a daemon away or slow makes it a miss or a skip (None), never an
error (hicache/client/client.py: the connection, the breaker and late answers).

CycleCalls is mixed into HiCacheClient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.client.ledger import LateHandler
from hicache.client.replies import (
    EMPTY, LATE, BackupPlan, InsertReply, Late, Match, PutPlan, StateBackupPlan, StateMatch,
)
from hicache.errors import DaemonSlow, DaemonUnavailable
from hicache.index.keys import as_tokens, page_keys
from hicache.rpc.framing import BlobRequest, bytes_to_ids, ids_to_bytes

if TYPE_CHECKING:
    from hicache.client.deadlines import CallDeadlines
    from hicache.client.prefill_rate import PrefillRate
    from hicache.layout import KVLayout


class CycleCalls:
    """HiCacheClient's lookups and stores (see the module docstring)."""

    if TYPE_CHECKING:  # HiCacheClient's
        salt: bytes
        layout: KVLayout
        engine_id: int | None
        epoch: int
        deadlines: CallDeadlines
        misses_while_away: int
        prefill_rate: PrefillRate
        connected: bool

        def _adopt_ready(self) -> bool: ...
        def _call(self, method: str, params: dict, timeout_s: float, *, map_slabs: bool = True,
                  on_late: LateHandler | None = None) -> Any: ...
        def _call_blob(self, request: BlobRequest, blob: bytes, timeout_s: float) -> Any: ...
        def _call_many(self, method: str, params: list[dict], timeout_s: float) -> list[Any]: ...
        def _match_request(self) -> BlobRequest: ...
        def _open(self, why: str) -> None: ...

    def page_keys(self, tokens: Any) -> list[bytes]:
        return page_keys(self.salt, as_tokens(tokens), self.layout.page_size)

    def match(self, tokens: Any = None, *, keys: list[bytes] | None = None) -> Match:
        """Longest cached prefix of `tokens`, per tier. A miss when the daemon is away."""
        self._adopt_ready()  # a request's lookup may use the connection the probe just made
        if keys is None:
            keys = self.page_keys(tokens)
        try:
            r = self._call_blob(self._match_request(), b"".join(keys), self.deadlines.match_s) if keys else None
        except DaemonUnavailable:
            self.misses_while_away += 1
            r = None
        if r is None:
            return Match(None, keys, EMPTY, EMPTY, 0, self.epoch)
        state = r.get("state")
        m = Match(int(r["pin"]), keys, bytes_to_ids(r["device_pages"]), bytes_to_ids(r["host_pages"]),
                  int(r["disk_len"]), self.epoch, 0, None if state is None else StateMatch.parse(state),
                  bool(r.get("pending", False)))
        if m.disk_len or m.pending or (state is not None and state["pending"]):
            # The disk part: the daemon's load policy says how long (best_effort: not at all). A
            # remote lookup still running: worth waiting for as long as computing the pages
            # beyond host would take (a slow or dead store must not hold every request).
            timeout_s = self.deadlines.load_s
            if m.pending:
                beyond = (len(keys) - m.device_len - m.host_len) * self.layout.page_size
                timeout_s = min(timeout_s, self.prefill_rate.worth_waiting_s(beyond))
            self.refresh(m, timeout_s)
        return m

    def refresh(self, match: Match, timeout_s: float | None = None) -> Match:
        """Fold into `match` what the daemon brought from disk or the remote store to host
        since (asking for the plan waits for a running remote lookup, then per the daemon's
        load policy; at most `timeout_s`, default load_s). Unchanged when the daemon is away
        or the wait is over first (what comes later is the next request's)."""
        if match.pin is None or match.epoch != self.epoch:
            return match
        try:
            ld = self._call("load", {"pin": match.pin}, self.deadlines.load_s if timeout_s is None else timeout_s)
        except DaemonUnavailable:
            return match
        host_pages = bytes_to_ids(ld["host_pages"])
        match.from_disk += len(host_pages) - len(match.host_pages)
        match.host_pages, match.disk_len = host_pages, int(ld["disk_len"])
        match.pending = bool(ld.get("pending", False))
        if "state" in ld:
            match.state = StateMatch.parse(ld["state"])
        return match

    def insert(self, tokens: Any, device_pages: np.ndarray, *, keys: list[bytes] | None = None,
               pin: Match | None = None, states: dict[int, int] | None = None,
               on_late: Callable[[InsertReply | None], None] | None = None) -> InsertReply | Late | None:
        """Offer the full pages of `tokens` (held in `device_pages`) to the cache, and for a
        hybrid model the state checkpoints it holds (`states`: position -> device state slot).
        None: skipped (daemon away) and the pages stay the engine's own.

        With `on_late`, a daemon too slow to answer in time is no lost connection: the call
        returns LATE (whether the daemon took the pages is unknown until its answer comes, so
        the engine keeps them, in doubt), and `on_late` gets the answer (None: refused) on
        a later call of this client; its backup plans are given back. Without it a late
        answer ends the connection (hicache/client/late.py).

        `keys` may hold the keys of a leading part of the pages (e.g. from the match of
        the prompt); only the pages after them are hashed, chained from the last one."""
        toks = as_tokens(tokens)
        ps = self.layout.page_size
        n = len(device_pages)
        keys = list(keys or ())
        if len(keys) > n:
            raise ValueError(f"{n} device pages for {len(keys)} page keys")
        if len(keys) < n:
            keys += page_keys(self.salt, toks[len(keys) * ps:n * ps], ps, parent=keys[-1] if keys else None)
        if len(keys) != n:
            raise ValueError(f"{n} device pages for {len(keys)} full pages of tokens")
        params = {"engine": self.engine_id, "keys": b"".join(keys),
                  "tokens": toks[:n * ps].tobytes(), "device_pages": ids_to_bytes(device_pages)}
        if pin is not None and pin.pin is not None and pin.epoch == self.epoch:
            params["pin"] = pin.pin
        if states:
            params["states"] = [[int(p), int(s)] for p, s in sorted(states.items())]
        late = None if on_late is None else self._late_insert(on_late)
        try:
            r = self._call("insert", params, self.deadlines.update_s, on_late=late)
        except DaemonSlow as e:
            return LATE if late is not None and e.sent and self.connected else None
        except DaemonUnavailable:
            return None
        return self._insert_reply(r)

    def _insert_reply(self, r: dict) -> InsertReply:
        sb = r.get("state_backup")
        state_plan = None if sb is None else StateBackupPlan(int(sb["id"]), list(sb["host_slots"]),
                                                             list(sb["device_slots"]), list(sb["positions"]),
                                                             self.epoch)
        return InsertReply(int(r["present_pages"]), bytes_to_ids(r["free_pages"]), self._plan(r["backup"]),
                           state_plan)

    def _late_insert(self, taker: Callable[[InsertReply | None], None]) -> LateHandler:
        """The handler of an insert's late answer: `taker` gets the reply; its backup plans
        are given back (the engine did not copy anything for them)."""
        def handler(outcome: Any) -> list[tuple[str, dict]] | None:
            reply = self._insert_reply(outcome) if type(outcome) is dict else None
            taker(reply)
            undo: list[tuple[str, dict]] = []
            if reply is not None and reply.backup is not None:
                undo.append(("backup_done", {"backup": reply.backup.backup_id, "ok": False}))
            if reply is not None and reply.state_backup is not None:
                undo.append(("state_backup_done", {"backup": reply.state_backup.backup_id, "ok": False}))
            return undo
        return handler

    def put(self, tokens: Any, *, keys: list[bytes] | None = None) -> PutPlan | None:
        """Reserve host pages for the full pages of `tokens` the host tier lacks, for an
        engine that keeps its own device cache (no device residency is recorded; see
        hicache/daemon/ingest/puts.py). None: skipped (daemon away)."""
        params = self._put_params(tokens, keys)
        try:
            r = self._call("put", params, self.deadlines.update_s)
        except DaemonUnavailable:
            return None
        return self._put_plan(r)

    def put_many(self, items: list[tuple[Any, list[bytes] | None]]) -> list[PutPlan | None]:
        """`put` for several prefixes, `(tokens, keys)` each, in one round trip (pipelined,
        handled in order, one `update_s` deadline for all): an engine step's reservations.
        Each None as for `put`; all None when the daemon is away or missed the deadline."""
        params = [self._put_params(tokens, keys) for tokens, keys in items]  # bad input: nothing sent
        if not params:
            return []
        try:
            replies = self._call_many("put", params, self.deadlines.update_s)
        except DaemonUnavailable:
            return [None] * len(params)
        return [None if r is None else self._put_plan(r) for r in replies]

    def _put_params(self, tokens: Any, keys: list[bytes] | None) -> dict:
        """`tokens` may come packed already (little-endian int32 bytes, with `keys`)."""
        ps = self.layout.page_size
        if isinstance(tokens, (bytes, bytearray, memoryview)) and keys is not None:
            n = len(keys)
            if len(tokens) < n * ps * 4:
                raise ValueError(f"{n} page keys need {n * ps} tokens, got {len(tokens) // 4}")
            packed = tokens if len(tokens) == n * ps * 4 else tokens[:n * ps * 4]
            return {"engine": self.engine_id, "keys": b"".join(keys), "tokens": packed}
        toks = as_tokens(tokens)
        if keys is None:
            keys = self.page_keys(toks)
        n = len(keys)
        if len(toks) < n * ps:
            raise ValueError(f"{n} page keys need {n * ps} tokens, got {len(toks)}")
        return {"engine": self.engine_id, "keys": b"".join(keys), "tokens": toks[:n * ps].tobytes()}

    def _put_plan(self, r: dict) -> PutPlan:
        put = r["put"]
        return PutPlan(None if put is None else int(put), int(r["present"]), bytes_to_ids(r["host_pages"]),
                       int(r["slabs"]), self.epoch)

    def _plan(self, b: dict | None) -> BackupPlan | None:
        if b is None:
            return None
        return BackupPlan(int(b["id"]), bytes_to_ids(b["host_pages"]), bytes_to_ids(b["device_pages"]), self.epoch)

    def evict(self, num_pages: int) -> tuple[np.ndarray, BackupPlan | None]:
        """Ask for about num_pages of this engine's cached device pages back. A daemon too
        slow to answer ends the connection (the engine, short of pages, takes its cached
        pages back itself, and the daemon forgets them only as it sees the close)."""
        try:
            r = self._call("evict", {"engine": self.engine_id, "num_pages": int(num_pages)},
                           self.deadlines.update_s)
        except DaemonSlow as e:
            self._open(f"evict: {e.message}")
            return EMPTY, None
        except DaemonUnavailable:
            return EMPTY, None
        return bytes_to_ids(r["free_pages"]), self._plan(r["backup"])
