"""Calls the engine sends now and collects later, never waiting: an engine whose
scheduler can come back to a request (vLLM's "ask again") looks up and reserves this
way, so no daemon round trip sits on its step (hicache/integrations/vllm/scheduler.py).

`ask_*` sends the call and returns an Ask at once; `poll()` (HiCacheClient) reads what
has arrived; `answer(ask)` is then the parsed answer, PENDING while none came, or None
for a miss (the daemon away, the connection lost since, a refusal). An Ask the engine
stops caring about is `drop`ped: what its answer grants (a match's pin, a put's host
pages) is given back when the answer comes (hicache/client/late.py). There is no
deadline on an Ask: the engine decides how long a lookup is worth waiting for, and
the connection's liveness probe decides when the daemon is dead.

AskCalls is mixed into HiCacheClient (hicache/client/client.py).
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from hicache.client.connection import RpcConnection
from hicache.client.ledger import Pending
from hicache.client.late import undo_late
from hicache.client.replies import EMPTY, Match, PutPlan, StateMatch
from hicache.errors import ClientError, DaemonUnavailable
from hicache.rpc.framing import BlobRequest, bytes_to_ids

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from hicache.client.deadlines import CallDeadlines


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING: Final = _Pending()  # an Ask's answer has not come yet


@dataclass(slots=True, eq=False)
class Ask:
    """One call sent without waiting (`sent` None: not sent, or its answer is void).
    `miss`: what it answers then."""

    sent: Pending | None
    epoch: int
    conn: RpcConnection | None
    parse: Callable[[Any], Any]
    miss: Any = None


def wait_for_answers(clients: Iterable[AskCalls], timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the daemon to answer any client's Ask, reading nothing:
    for an engine that has nothing to do until an answer comes (vLLM's step scheduled no
    token while its lookups are out), instead of asking again through empty steps that
    spin it for nothing. True when something waits to be read (at once when an answer is
    already buffered); False when nothing is owed, or nothing came in time."""
    poller = None
    for c in clients:
        conn = c.conn
        if conn is None or conn.closed or not conn.owed:
            continue
        if conn.buffered:
            return True
        if poller is None:
            poller = select.poll()
        poller.register(conn.sock, select.POLLIN)
    return poller is not None and bool(poller.poll(timeout_s * 1000))


class AskCalls:
    """HiCacheClient's calls answered later (see the module docstring)."""

    if TYPE_CHECKING:  # HiCacheClient's
        conn: RpcConnection | None
        engine_id: int | None
        epoch: int
        deadlines: CallDeadlines
        posted_calls: Any
        calls: Any

        def _match_request(self) -> BlobRequest: ...
        def _put_params(self, tokens: Any, keys: list[bytes] | None) -> dict: ...
        def _put_plan(self, r: dict) -> PutPlan: ...
        def _check_slabs(self, reply: Any) -> None: ...
        def _open(self, why: str) -> None: ...
        def _adopt_ready(self) -> bool: ...

    def _live_conn(self) -> RpcConnection | None:
        conn = self.conn
        if conn is None or conn.closed:
            self._adopt_ready()
            conn = self.conn
        return conn if conn is not None and not conn.closed else None

    def ask_match(self, keys: list[bytes]) -> Ask:
        """`match` of `keys`, answered later (a Match; pin None for a miss)."""
        epoch = self.epoch
        miss = Match(None, keys, EMPTY, EMPTY, 0, epoch)

        def parse(r: dict) -> Match:
            state = r.get("state")
            return Match(int(r["pin"]), keys, bytes_to_ids(r["device_pages"]), bytes_to_ids(r["host_pages"]),
                         int(r["disk_len"]), epoch, 0, None if state is None else StateMatch.parse(state),
                         bool(r.get("pending", False)))
        return self._ask(lambda conn: conn.send_blob(self._match_request(), b"".join(keys), self.deadlines.match_s),
                         "match", parse, miss, bool(keys))

    def _ask(self, send: Callable[[RpcConnection], Pending], method: str, parse: Callable[[Any], Any], miss: Any,
             wanted: bool = True) -> Ask:
        conn = self._live_conn() if wanted else None
        if conn is None:
            return Ask(None, self.epoch, None, parse, miss)
        self.calls[method] += 1
        try:
            sent = send(conn)
        except DaemonUnavailable as e:
            self._open(e.message)
            return Ask(None, self.epoch, None, parse, miss)
        return Ask(sent, self.epoch, conn, parse, miss)

    def ask_load(self, match: Match, until: str = "complete") -> Ask:
        """`load` of `match`'s disk and remote parts (see the daemon's load handler): the
        Match answered is `match` updated with what reached host, as `refresh` does."""
        def parse(r: dict) -> Match:
            host_pages = bytes_to_ids(r["host_pages"])
            match.from_disk += len(host_pages) - len(match.host_pages)
            match.host_pages, match.disk_len = host_pages, int(r["disk_len"])
            match.pending = bool(r.get("pending", False))
            return match
        return self._ask(lambda conn: conn.send("load", {"pin": match.pin, "until": until}, self.deadlines.load_s),
                         "load", parse, match, match.pin is not None and match.epoch == self.epoch)

    def ask_puts(self, items: list[tuple[Any, list[bytes] | None]]) -> list[Ask]:
        """`put` of several prefixes, `(tokens, keys)` each, in one write; each answered
        later (a PutPlan, None when skipped)."""
        params = [self._put_params(tokens, keys) for tokens, keys in items]  # bad input: nothing sent
        conn = self._live_conn() if params else None
        if conn is None:
            return [Ask(None, self.epoch, None, self._put_plan) for _ in params]
        self.calls["put"] += len(params)
        try:
            sent = conn.send_many([("put", p) for p in params], self.deadlines.update_s)
        except DaemonUnavailable as e:
            self._open(e.message)
            return [Ask(None, self.epoch, None, self._put_plan) for _ in params]
        return [Ask(s, self.epoch, conn, self._put_plan) for s in sent]

    def answer(self, ask: Ask) -> Any:
        """The Ask's parsed answer; PENDING while none came; None for a miss (not sent,
        refused, the connection lost since: the daemon freed what it granted)."""
        sent = ask.sent
        if sent is None:
            return ask.miss
        if not sent.done:
            if ask.conn is self.conn and not ask.conn.closed:  # type: ignore[union-attr]
                return PENDING
        elif type(sent.outcome) is dict and ask.epoch == self.epoch:
            self._check_slabs(sent.outcome)
            return ask.parse(sent.outcome)
        ask.sent = None  # refused, or its connection is gone (the daemon freed what it granted)
        if isinstance(sent.outcome, ClientError):
            log.error("hicache daemon refused %s: %s", sent.method, sent.outcome)
        return ask.miss

    def drop(self, ask: Ask) -> None:
        """The engine will not use this Ask's answer: what it grants is given back when it
        comes (at once, if it came)."""
        sent, conn = ask.sent, ask.conn
        ask.sent = None
        if sent is None or conn is None or conn.closed or conn is not self.conn:
            return
        try:
            conn.abandon(sent, undo_late(sent.method, self.engine_id))
        except DaemonUnavailable as e:
            self._open(e.message)
