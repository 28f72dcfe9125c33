"""HiCacheClient: the engine's synchronous view of the daemon.

An engine must never crash or hang because the daemon is gone or hung. Every
call has a deadline suited to its place on the engine's critical path
(hicache/client/deadlines.py). A call that fails (refused, broken, timed out)
opens the circuit breaker: the connection is dropped, lookups answer a miss and
stores are skipped at once, and a background probe reconnects
(hicache/client/reconnect.py); the engine thread adopts the probe's connection
on its next call. Each adoption bumps `epoch`; the daemon forgets an engine's
device residency when its connection drops, so the engine-side cache layer
treats a new epoch, and a dropped connection, as "the daemon no longer tracks
any of my device pages".
Before anything is sent, the listener's uid is checked (hicache/client/peer.py).

Here: the connection, the breaker and late answers. The engine cycle's lookups and
stores are hicache/client/cycle.py; what the answers become is in
hicache/client/replies.py; the reports of what the engine did with them in
hicache/client/reports.py; retention hints in hicache/client/retention.py; calls
answered later (vLLM's scheduler) in hicache/client/asks.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn


from hicache.config import default_socket_path
from hicache.errors import ClientError, DaemonSlow, DaemonUnavailable, HiCacheError
from hicache.index.keys import Namespace
from hicache.layout import KVLayout
from hicache.state_layout import StateLayout
from hicache.rpc.framing import BlobRequest
from hicache.client.connection import RpcConnection, _close_fd
from hicache.client.deadlines import CallDeadlines
from hicache.client.late import ENDS_ON_LATE, HELD, undo_late
from hicache.client.ledger import LateHandler
from hicache.client.peer import trusted_daemon_uids
from hicache.client.prefill_rate import PrefillRate
from hicache.client.reconnect import Reconnector
from hicache.client.replies import (  # re-exported: the engine cycle's answers
    EMPTY, BackupPlan, InsertReply, Match, PutPlan, StateBackupPlan, StateMatch,
)
from hicache.client.asks import AskCalls
from hicache.client.cycle import CycleCalls
from hicache.client.slabs import SlabCalls
from hicache.client.reports import ReportCalls
from hicache.client.retention import RetentionCalls
from hicache.tiers.host.arena import HostArena

log = logging.getLogger(__name__)



@dataclass(slots=True)
class _Handshake:
    """A connection made off the engine's path: peer checked, hello'd, registered."""

    conn: RpcConnection
    hello: dict
    fds: list[int]
    reply: dict = field(default_factory=dict)
    prefill_rate: float | None = None  # the rate register told the daemon

    def close(self) -> None:
        self.conn.close()
        for fd in self.fds:
            _close_fd(fd)
        self.fds = []


class HiCacheClient(SlabCalls, CycleCalls, ReportCalls, RetentionCalls, AskCalls):
    """`deadlines` (default CallDeadlines()): seconds per call kind; `timeout_s` is a shorthand
    for the same deadline on every call. `backoff_s`: (first, longest) pause between background
    reconnect attempts. `daemon_uids`: uids (or user names) trusted to serve the socket besides
    this user and root (default: $HICACHE_DAEMON_UIDS, else the `hicache` service user).
    `prefill_tokens_per_s`: the engine's prefill rate, for the daemon's fetch-or-recompute rule;
    without it the engine may time its prefills (`note_prefill`) instead. `store_pages`: the
    most pages one store of this engine writes (SGLang: its storage batch), so the daemon keeps
    host slabs of that room mapped and pre-faulted here before the first store."""

    def __init__(self, layout: KVLayout, device_pages: int, *, model: str, socket_path: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, extra_key: str = "", timeout_s: float | None = None,
                 backoff_s: tuple[float, float] = (0.05, 2.0), state: StateLayout | None = None,
                 deadlines: CallDeadlines | None = None, daemon_uids: Iterable[int | str] | None = None,
                 prefill_tokens_per_s: float | None = None, store_pages: int = 0) -> None:
        if timeout_s is not None and deadlines is not None:
            raise ValueError("pass timeout_s or deadlines, not both")
        self.layout = layout
        self.device_pages = device_pages
        self.namespace = Namespace(model, layout, tp_rank, tp_size, extra_key, state)
        self.salt = self.namespace.salt()
        self.socket_path = str(socket_path or os.environ.get("HICACHE_SOCKET_PATH") or default_socket_path())
        self.deadlines = deadlines or (CallDeadlines() if timeout_s is None else CallDeadlines.uniform(timeout_s))
        self.daemon_uids = trusted_daemon_uids(daemon_uids)
        self.backoff_s = backoff_s
        self.conn: RpcConnection | None = None
        self.engine_id: int | None = None
        self.epoch = 0
        self.arena: HostArena | None = None  # the daemon's arena; only our namespace's slabs mapped
        self.slab_version = 0  # of the slabs mapped; replies naming host pages carry the daemon's
        self.instance: str | None = None  # the daemon's, from hello: a new one has a new arena
        self.on_reconnect: list[Any] = []  # callbacks(epoch) run after each (re)connect, on the engine thread
        # callbacks() run on the engine thread as the connection is dropped (a failed call, close),
        # before its socket closes: the daemon frees what the connection held once it sees the
        # close, so copies into or out of its host pages must end first
        self.on_disconnect: list[Any] = []
        self.misses_while_away = 0
        self.refusals = 0
        self.outages = 0  # times the breaker opened
        self.late = 0  # waited calls given up at their deadline (a miss or a skip; the connection stays)
        self._slow_since: float | None = None  # the last call went late and the daemon has not answered since
        self.round_trips = 0  # exchanges that waited for the daemon (a pipelined batch is one; hello, slabs aside)
        self.posted = 0  # calls sent without waiting (`_post`)
        self.calls: Counter[str] = Counter()  # waited calls by method (each of a pipelined batch counts)
        self.posted_calls: Counter[str] = Counter()  # posted by method
        self._reconnector: Reconnector[_Handshake] | None = None
        self.prefill_rate = PrefillRate(prefill_tokens_per_s)  # before connecting: register sends it
        self.store_pages = store_pages
        self._match_req: BlobRequest | None = None  # `match`'s frame template (`_match_request`)
        # False for a client that never touches host pages itself (the vLLM scheduler: its workers
        # copy): the slab versions answers name are only recorded, never mapped
        self.map_arena = True
        # True: calls wait in the connection's outbox until `flush` (RpcConnection.corked)
        self.corked = False

    # -- connection management -------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.closed

    @property
    def reconnect_ready(self) -> bool:
        """The background probe made a connection; the next call (or `poll`) adopts it."""
        return self._reconnector is not None and self._reconnector.ready

    @property
    def reconnect_attempts(self) -> int:
        """Attempts of the background probe since the breaker last opened (0 when none runs)."""
        return 0 if self._reconnector is None else self._reconnector.attempts

    def connect(self) -> bool:
        """Connect now, on this thread (at start-up, or to skip the probe's backoff); each step
        waits at most `deadlines.connect_s`. True when connected and registered; otherwise the
        background probe keeps trying."""
        if self.connected or self._adopt_ready():
            return True
        if self._reconnector is not None:
            self._reconnector.close()
            self._reconnector = None
        try:
            hs = self._handshake()
        except DaemonUnavailable as e:
            self._open(str(e))
            return False
        self._adopt(hs)
        return True

    def poll(self) -> bool:
        """Adopt a connection the background probe made, running `on_reconnect` here (the
        engine thread), and read what the daemon has answered since, without waiting (late
        answers given back, answers to `ask`s); True when connected. Engines may call it
        when idle; `match` does."""
        self._adopt_ready()
        conn = self.conn
        if conn is not None and not conn.closed:
            try:
                conn.poll()
            except DaemonUnavailable as e:
                self._open(e.message)
        return self.connected

    def _handshake(self) -> _Handshake:
        """Connect, check the peer, hello, register (the probe thread runs this too: it
        touches nothing of the client but its immutable settings)."""
        d = self.deadlines
        conn = RpcConnection.connect(self.socket_path, d.connect_s, self.daemon_uids)
        try:
            hello, fds = conn.hello(timeout_s=d.connect_s)
        except BaseException:
            conn.close()
            raise
        hs = _Handshake(conn, hello, fds)
        try:
            params = {"model": self.namespace.model, "layout": self.layout.to_dict(),
                      "tp_rank": self.namespace.tp_rank, "tp_size": self.namespace.tp_size,
                      "extra_key": self.namespace.extra_key, "device_pages": self.device_pages}
            if self.namespace.state is not None:
                params["state"] = self.namespace.state.to_dict()
            hs.prefill_rate = self.prefill_rate.tokens_per_s
            if hs.prefill_rate is not None:
                params["prefill_tokens_per_s"] = hs.prefill_rate
            if self.store_pages:
                params["store_pages"] = self.store_pages
            hs.reply = conn.call("register", params, timeout_s=d.connect_s)
        except BaseException:
            hs.close()
            raise
        return hs

    def _adopt_ready(self) -> bool:
        if self._reconnector is None:
            return False
        hs = self._reconnector.take()
        if hs is None:
            return False
        self._reconnector = None  # its thread ended when it parked the connection
        self._adopt(hs)
        return True

    def _adopt(self, hs: _Handshake) -> None:
        conn, hello, fds, reply = hs.conn, hs.hello, hs.fds, hs.reply
        if reply["salt"] != self.salt:
            hs.close()
            self._open("namespace salt mismatch")
            raise ClientError("BAD_NAMESPACE", "the daemon computed a different namespace salt")
        for fd in fds:  # a daemon of this protocol sends none with hello
            os.close(fd)
        old_arena = self.arena
        self.arena = HostArena.reserve(int(hello["num_slabs"]), int(hello["slab_bytes"]))
        self.slab_version = 0
        self.conn = conn
        conn.on_close = self._closing
        conn.liveness_s = self.deadlines.liveness_s
        conn.corked = self.corked
        self.instance = hello.get("instance")
        self.engine_id = int(reply["engine"])
        self.prefill_rate.sent(hs.prefill_rate)
        self.epoch += 1
        log.info("connected to hicache daemon %s (engine %d, epoch %d)", hello.get("server"), self.engine_id,
                 self.epoch)
        self._check_slabs(reply)
        for cb in list(self.on_reconnect):
            cb(self.epoch)
        if old_arena is not None:  # a restarted daemon has a new arena; the callbacks left the old one
            old_arena.close()

    def _closing(self) -> None:
        for cb in list(self.on_disconnect):
            try:
                cb()
            except Exception:  # one failing callback must not keep the others from running
                log.exception("hicache on_disconnect callback failed")

    def _open(self, why: str) -> None:
        """Open the breaker: drop the connection, probe in the background (once)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._reconnector is None:
            self.outages += 1
            log.warning("hicache daemon unavailable (%s): answering misses and skipping stores while "
                        "reconnecting in the background", why)
            self._reconnector = Reconnector(self._handshake, self.backoff_s)
            self._reconnector.start()

    def _require_connection(self) -> None:
        """DaemonUnavailable unless connected. Every cycle call carries ids (engine, pin,
        backup) of the epoch it was built in; a connection adopted here would get them from
        a daemon that never issued them. So this call is a miss, and the new connection
        serves the next one. DaemonSlow, with nothing sent, while the daemon has not
        answered since a call went late (the connection's liveness probe is out): a slow
        daemon costs the engine one deadline, then nothing until it answers again."""
        if not self.connected:
            if not self._adopt_ready():
                self._open("not connected")
            raise DaemonUnavailable("daemon unavailable" if not self.connected else "daemon reconnected")
        conn = self.conn
        assert conn is not None
        if conn.suspect:
            try:
                conn.poll()
            except DaemonUnavailable as e:
                self._open(e.message)
                raise
            if conn.suspect:
                raise DaemonSlow("the daemon has not answered since a call went late; not waiting", sent=False)
        if self._slow_since is not None:
            log.info("hicache daemon answering again after %.2f s", time.monotonic() - self._slow_since)
            self._slow_since = None

    def _call(self, method: str, params: dict, timeout_s: float, *, map_slabs: bool = True,
              on_late: LateHandler | None = None) -> Any:
        """One RPC within `timeout_s`; raises DaemonUnavailable when the daemon is away, hung
        or refused the call. Slabs the reply says we lack are mapped first, unless not
        `map_slabs` (the caller maps them when it needs them, `_check_slabs`). A late answer
        goes to `on_late` when given (the caller takes it, and the connection stays even
        for a call that moves device pages), else to late.py's handler for the method.

        A refusal (ClientError) on the engine cycle means a bug on one side; the engine
        must keep serving, so it is logged and treated like an absent daemon: a miss,
        a skipped store."""
        self._require_connection()
        assert self.conn is not None
        self.round_trips += 1
        self.calls[method] += 1
        try:
            reply = self.conn.call(method, params, timeout_s, probe=method not in HELD,
                                   on_late=on_late or undo_late(method, self.engine_id))
        except (DaemonUnavailable, ClientError) as e:
            self._failed(method, e, ends=on_late is None)
        if map_slabs:
            self._check_slabs(reply)
        return reply

    def _call_blob(self, request: BlobRequest, blob: bytes, timeout_s: float) -> Any:
        """`_call` of a request built from a template (RpcConnection.call_blob)."""
        self._require_connection()
        assert self.conn is not None
        self.round_trips += 1
        self.calls[request.method] += 1
        try:
            reply = self.conn.call_blob(request, blob, timeout_s, on_late=undo_late(request.method, self.engine_id))
        except (DaemonUnavailable, ClientError) as e:
            self._failed(request.method, e)
        self._check_slabs(reply)
        return reply

    def _failed(self, method: str, e: HiCacheError, ends: bool = True) -> NoReturn:
        """A call that failed: DaemonUnavailable raised. No answer in time (DaemonSlow) keeps
        the connection (hicache/client/late.py gives back what the late answer grants),
        except for calls that move device pages whose caller does not take the late answer
        (`ends`); a dead connection opens the breaker."""
        if isinstance(e, DaemonSlow):
            self._late(method, e, ends=ends)
            raise e
        if isinstance(e, DaemonUnavailable):
            self._open(e.message)
            raise e
        self.refusals += 1
        log.error("hicache daemon refused %s: %s", method, e)
        raise DaemonUnavailable(f"{method} refused: {e}") from e

    def _late(self, method: str, e: DaemonSlow, count: int = 1, ends: bool = True) -> None:
        self.late += count
        if method in ENDS_ON_LATE and ends:  # see late.py: the engine and the daemon would disagree on device pages
            self._open(f"{method}: {e.message}")
        elif method in HELD:  # the daemon holds it for a read: a miss of that part, nothing more
            log.debug("hicache: %s", e.message)
        elif self._slow_since is None:
            self._slow_since = time.monotonic()
            log.warning("hicache daemon slow (%s): answering misses and skipping stores until it answers "
                        "again; the connection is kept", e.message)

    def _match_request(self) -> BlobRequest:
        """The `match` frame's template for this engine id (one per registration)."""
        req = self._match_req
        if req is None or req.fixed["engine"] != self.engine_id:
            req = self._match_req = BlobRequest("match", {"engine": self.engine_id}, "keys")
        return req

    def _call_many(self, method: str, params: list[dict], timeout_s: float) -> list[Any]:
        """Several calls of `method`, pipelined (RpcConnection.call_many): one round trip,
        one deadline for all. The breaker as for `_call`: DaemonUnavailable when the
        daemon is away or the connection broke (the dropped connection took what they
        reserved). A refused call, or one not answered in time (given back when its answer
        comes, hicache/client/late.py), holds None in its place."""
        self._require_connection()
        assert self.conn is not None
        self.round_trips += 1
        self.calls[method] += len(params)
        try:
            replies = self.conn.call_many([(method, p) for p in params], timeout_s,
                                          on_late=undo_late(method, self.engine_id))
        except DaemonUnavailable as e:
            self._open(e.message)
            raise
        late = sum(isinstance(r, DaemonSlow) for r in replies)
        if late:
            self._late(method, next(r for r in replies if isinstance(r, DaemonSlow)), late)
        for i, r in enumerate(replies):
            if isinstance(r, DaemonSlow):
                replies[i] = None
            elif isinstance(r, ClientError):
                self.refusals += 1
                log.error("hicache daemon refused %s: %s", method, r)
                replies[i] = None
        # the newest slab version any answer names (they only grow): map once for all of them
        newest = max((r["slabs"] for r in replies if type(r) is dict and "slabs" in r), default=None)
        if newest is not None:
            self._check_slabs({"slabs": newest})
        return replies

    def _post(self, method: str, params: dict) -> bool:
        """Send a call whose answer the engine does not need, without waiting for it: a
        starved daemon then costs the engine's step nothing. Order is kept: the daemon
        handles the next call after this one. A call of an earlier epoch is void (the
        daemon that issued its ids is gone); a refusal is logged when its answer is read
        (RpcConnection.post). False: not sent (the daemon is away)."""
        return self._post_many([(method, params)])

    def _post_many(self, calls: list[tuple[str, dict]]) -> bool:
        """`_post` of several calls in one write."""
        if not self.connected:
            if not self._adopt_ready():
                self._open("not connected")
            return False
        assert self.conn is not None
        self.posted += len(calls)
        for method, _ in calls:
            self.posted_calls[method] += 1
        try:
            self.conn.post_many(calls)
        except DaemonUnavailable as e:
            self._open(e.message)
            return False
        return True

    def _report(self, method: str, params: dict, *, wait: bool = True) -> dict | None:
        """A call whose answer the engine may skip (the reports of hicache/client/reports.py,
        the hints of hicache/client/retention.py), within `update_s`. The daemon's answer, None
        when it is away or refused (see `_call`); `wait=False` posts it (see `_post`): {} when
        sent, None when not."""
        if not wait:
            return {} if self._post(method, params) else None
        try:
            return self._call(method, params, self.deadlines.update_s)
        except DaemonUnavailable:
            return None

    def flush(self) -> None:
        """Send the calls a corked client queued, in one write."""
        conn = self.conn
        if conn is not None and not conn.closed:
            try:
                conn.flush()
            except DaemonUnavailable as e:
                self._open(e.message)

    @property
    def unsent(self) -> bool:
        """Calls queued and not sent yet (a corked client's, until `flush`)."""
        return self.conn is not None and not self.conn.closed and self.conn.unsent

    def wait_posted(self) -> None:
        """Wait until the daemon has handled every call sent without waiting (`_post`)."""
        if self.conn is None:
            return
        try:
            self.conn.wait_posted(self.deadlines.update_s)
        except DaemonSlow as e:
            self._late("sync", e)
        except DaemonUnavailable as e:
            self._open(e.message)

    def close(self) -> None:
        if self._reconnector is not None:
            self._reconnector.close()
            self._reconnector = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def stats(self) -> dict:
        """The daemon's stats (connecting now if needed); DaemonUnavailable when it is away."""
        if not self.connect():
            raise DaemonUnavailable("daemon unavailable")
        return self._call("stats", {}, self.deadlines.admin_s)


__all__ = ["HiCacheClient", "CallDeadlines", "EMPTY", "Match", "InsertReply", "PutPlan", "BackupPlan", "StateMatch", "StateBackupPlan"]
