"""The answers a connection is owed by the daemon, and what to do with each when it comes.

A request is one of: sent and waited for (its answer is read by the call itself), sent
to be collected later (a Pending), given up at its deadline (late: its answer goes to
an `on_late` handler, whose undo calls are posted), or posted (answered only to refuse
it). The daemon handles a connection's requests in order, so an answer to one request
settles every posted request sent before it. One more request is special: the liveness
probe (`sync`) sent after a call goes late or overdue; while it is unanswered the
connection is *suspect*, and once it is older than `liveness_s` the daemon is dead.

The ledger only keeps the books; hicache/client/connection.py sends and reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.errors import ClientError

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0  # between probes while answers stay overdue (a long disk read, a busy daemon)
_monotonic = time.monotonic

# on_late(outcome) -> the calls (method, params) that undo what a late answer granted, or None
LateHandler = Callable[[Any], "list[tuple[str, dict]] | None"]


def outcome(msg: dict) -> Any:
    """An answer's result, or its refusal as a ClientError (returned, not raised)."""
    if "error" in msg:
        err = msg["error"]
        return ClientError(str(err.get("code")), str(err.get("message")))
    return msg.get("result")


@dataclass(slots=True, eq=False)
class Pending:
    """A call sent without waiting (`send`): `done` once its answer was read, `outcome` then
    its result or its refusal (a ClientError). `due`: when it counts as overdue, which
    starts a liveness probe (the call itself is never given up by the connection)."""

    req_id: int
    method: str
    due: float
    done: bool = False
    outcome: Any = None


class AnswerLedger:
    def __init__(self) -> None:
        # id -> method of requests sent by post() that may still be answered (they are only
        # when refused); an answer to any later request settles them
        self.posted: dict[int, str] = {}
        self.pending: dict[int, Pending] = {}  # sent by `send`, answer not read yet
        self.late: dict[int, tuple[str, LateHandler | None]] = {}  # given up; undo what they grant
        self.undo: list[tuple[str, dict]] = []  # calls on_late handlers asked for, to be posted
        self.probe: Pending | None = None  # the liveness probe out, if any
        self.settle: Pending | None = None  # a `sync` settling posted requests
        self._next_due = float("inf")
        self._probe_after = 0.0
        self.posted_refusals = 0  # posted requests the daemon answered with an error
        self.given_up = 0  # calls whose deadline passed before their answer
        self.late_answers = 0  # answers read after their call was given up

    def track(self, req_id: int, method: str, due: float) -> Pending:
        p = self.pending[req_id] = Pending(req_id, method, due)
        if due < self._next_due:
            self._next_due = due
        return p

    def give_up(self, req_id: int, method: str, on_late: LateHandler | None) -> None:
        """A waited call's deadline passed: its answer goes to `on_late`."""
        self.late[req_id] = (method, on_late)
        self.given_up += 1

    def abandon(self, p: Pending, on_late: LateHandler | None) -> None:
        """A sent call nobody wants any more: `on_late` gets its answer (now, if it came)."""
        if p.done:
            if on_late is not None:
                self.undo.extend(on_late(p.outcome) or ())
        elif self.pending.pop(p.req_id, None) is not None:
            self.late[p.req_id] = (p.method, on_late)

    def probe_needed(self, now: float) -> bool:
        """Whether a sent call has become overdue and no probe is out (checked at most
        every PROBE_INTERVAL_S while one stays overdue)."""
        if now < self._next_due:
            return False
        due = min((p.due for p in self.pending.values() if p is not self.probe), default=float("inf"))
        needed = due <= now and self.probe is None and now >= self._probe_after
        self._next_due = now + PROBE_INTERVAL_S if due <= now else due
        return needed

    def dead(self, now: float) -> bool:
        """The probe went unanswered for the liveness time it was sent with (its `due`)."""
        return self.probe is not None and now > self.probe.due

    def answered(self, req_id: int) -> None:
        """An answer to `req_id`: every request sent before it was handled (the daemon takes
        a connection's requests in order), so the posted ones before it are settled."""
        posted = self.posted
        if posted:
            for k in [k for k in posted if k < req_id]:
                del posted[k]

    def dispatch(self, msg: dict, events: Any) -> None:
        """A message nobody is reading for right now: an event, an answer to a sent call,
        a late answer, or a posted request's refusal."""
        if "event" in msg:
            events.append(msg["event"])
            return
        req_id = msg.get("id")
        p = self.pending.pop(req_id, None)  # type: ignore[arg-type]
        if p is not None:
            p.done, p.outcome = True, outcome(msg)
            if p is self.probe:
                self.probe = None
                self._probe_after = _monotonic() + PROBE_INTERVAL_S
            elif p is self.settle:
                self.settle = None
            self.answered(p.req_id)
            return
        late = self.late.pop(req_id, None)  # type: ignore[arg-type]
        if late is not None:
            self.late_answers += 1
            on_late = late[1]
            if on_late is not None:
                self.undo.extend(on_late(outcome(msg)) or ())
            self.answered(req_id)  # type: ignore[arg-type]
            return
        method = self.posted.pop(req_id, None)  # type: ignore[arg-type]
        if method is not None and "error" in msg:
            err = msg["error"]
            self.posted_refusals += 1
            log.warning("hicache daemon refused %s (sent without waiting): %s: %s", method, err.get("code"),
                        err.get("message"))

    def take_undo(self) -> list[tuple[str, dict]]:
        undo, self.undo = self.undo, []
        return undo
