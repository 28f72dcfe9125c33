"""A blocking RPC connection to the daemon (engine schedulers are synchronous) on which
a slow answer is a miss, never a lost connection.

Every request carries an id and its answer carries it back, so the stream never loses
its place: a call past its deadline raises DaemonSlow and keeps the connection; its
answer, when it comes, goes to the call's `on_late` handler, whose undo calls (a pin
released, a reservation given back) are posted at once, in order (the books:
hicache/client/ledger.py). A liveness probe (`sync`) then goes out; until it is
answered the connection is *suspect* and the client sends no waited call. Only a dead
socket, a broken frame, no probe answered within `liveness_s`, or MAX_OUTBOX_BYTES the
daemon does not read end the connection (DaemonUnavailable).

Three ways to call: `call` waits up to a deadline; `send` returns a Pending at once and
`poll` reads what has arrived without waiting (the vLLM scheduler asks again next step);
`post` sends a call whose answer nobody needs: the daemon answers it only to refuse it.
Sends never block: what the socket cannot take waits in an outbox that every later
operation flushes first, so order is kept. The socket's reads and writes are hicache/client/socket_io.py;
`connect` checks who listens (hicache/client/peer.py) before a byte is sent.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, NoReturn

from hicache.client.deadlines import LIVENESS_S  # a daemon that answers no probe this long is hung
from hicache.client.socket_io import MAX_FDS, MAX_FRAME_BYTES, RECV_CHUNK, FrameReader, Outbox
from hicache.client.ledger import AnswerLedger, LateHandler, Pending
from hicache.client.peer import check_daemon
from hicache.errors import ClientError, DaemonRefused, DaemonSlow, DaemonUnavailable
from hicache.rpc.framing import HEADER, BlobRequest, new_packer, pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION

__all__ = ["MAX_FDS", "MAX_FRAME_BYTES", "RECV_CHUNK", "LIVENESS_S", "LateHandler", "Pending", "RpcConnection"]

REFUSED_CODES = {"FORBIDDEN"}  # a daemon that says why it refuses this peer
MAX_POSTED = 64  # posted requests not known handled; beyond, a `sync` is sent (not waited) to settle them
# call_many's window: requests sent before their answers are read. The daemon handles 64 frames a
# loop turn (FRAMES_PER_TURN) and stops reading while its output is unread, so a window stays
# well under a Unix socket's buffer (~208 KiB).
MAX_PIPELINED = 64
PIPELINE_BYTES = 128 << 10
_monotonic = time.monotonic

log = logging.getLogger(__name__)


class RpcConnection:
    def __init__(self, sock: socket.socket, timeout_s: float, liveness_s: float = LIVENESS_S) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self._ids = itertools.count(1)
        self.events: deque[dict] = deque(maxlen=65536)
        self.closed = False
        # called once as the connection is dropped, before the socket closes: the daemon frees
        # what the connection held as soon as it sees the close
        self.on_close: Callable[[], None] | None = None
        self._packer = new_packer()  # a connection is one thread's at a time
        self._reader = FrameReader(sock, timeout_s, self._lost)
        self._outbox = Outbox(sock, self._lost)
        self.ledger = AnswerLedger()

    @classmethod
    def connect(cls, path: str, timeout_s: float = 5.0, daemon_uids: Collection[int] | None = None
                ) -> RpcConnection:
        """Connect and check the listener's uid (`daemon_uids`: the trusted ones, default
        per hicache/client/peer.py); DaemonUntrusted, with nothing sent, when it is not."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(_connect_failure(path, e)) from e
        try:
            check_daemon(sock, path, daemon_uids)
        except BaseException:
            sock.close()
            raise
        return cls(sock, timeout_s)

    @classmethod
    def one_call(cls, path: str, method: str, params: dict[str, Any] | None = None,
                 timeout_s: float = 5.0) -> Any:
        """Connect (checking who listens), hello, one call, close: the admin CLI's and
        tools' way to ask the daemon something."""
        conn = cls.connect(path, timeout_s=timeout_s)
        try:
            conn.hello()
            return conn.call(method, params or {})
        finally:
            conn.close()

    @property
    def unsent(self) -> bool:
        """Frames wait in the outbox (corked, or the socket was full)."""
        return bool(self._outbox.data)

    @property
    def corked(self) -> bool:
        """Frames wait in the outbox until `flush` (or a waited call) sends them in one write."""
        return self._outbox.corked

    @corked.setter
    def corked(self, on: bool) -> None:
        self._outbox.corked = on

    @property
    def owed(self) -> bool:
        """Answers to calls sent by `send` (or a probe) have not all been read."""
        return bool(self.ledger.pending)

    @property
    def buffered(self) -> bool:
        """Bytes from the daemon are read and not dispatched yet (the next `poll` takes them)."""
        return self._reader.buffered

    @property
    def suspect(self) -> bool:
        """An answer came too late and the daemon has not answered the probe sent after it."""
        return self.ledger.probe is not None

    @property
    def posted_refusals(self) -> int:
        return self.ledger.posted_refusals

    @property
    def given_up(self) -> int:
        return self.ledger.given_up

    @property
    def late_answers(self) -> int:
        return self.ledger.late_answers

    def hello(self, timeout_s: float | None = None) -> tuple[dict, list[int]]:
        """Handshake: negotiate the version. Returns the answer and any descriptors that came
        with it (none from a daemon of this protocol; the caller closes them).

        Its own deadline matters: `connect()` succeeds into a stopped daemon's listen
        backlog, so only the hello tells a live daemon from a hung one: a hello that is not
        answered in time ends the connection."""
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = _monotonic() + t
        req_id = next(self._ids)
        fds: list[int] = []
        try:
            self._send_frame(pack_frame({"id": req_id, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
            msg = self._await(req_id, deadline, fds)
        except DaemonUnavailable as e:
            for fd in fds:
                _close_fd(fd)
            cause = e.__cause__
            if not fds and (cause is None or isinstance(cause, (ConnectionResetError, BrokenPipeError))):
                # The daemon hangs up on a peer it does not allow before reading a byte.
                raise DaemonRefused("refused by the daemon (peer credentials): it closed the connection "
                                    "before answering hello (this uid/group is not allowed, or it is "
                                    "shutting down)") from e
            raise DaemonUnavailable(f"hello failed: {e.message}") from e
        if msg is None:
            for fd in fds:
                _close_fd(fd)
            self.close()
            raise DaemonUnavailable(f"hello failed: no answer in {t:g}s (the daemon is hung or overloaded)")
        if "error" in msg:
            for fd in fds:
                _close_fd(fd)
            err = msg["error"]
            if err.get("code") in REFUSED_CODES:
                self.close()
                raise DaemonRefused(f"refused by the daemon (peer credentials): {err.get('message', '')}")
            raise ClientError(err.get("code", "INTERNAL"), err.get("message", ""))
        return msg["result"], fds

    # -- waited calls ------------------------------------------------------------
    def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = None, *,
             fds: list[int] | None = None, on_late: LateHandler | None = None, probe: bool = True) -> Any:
        """One request; its result within `timeout_s` (the connection's default when None).
        A refusal raises ClientError; no answer in time raises DaemonSlow and keeps the
        connection (`on_late` gets the answer when it comes). With `fds`, descriptors that
        come with the answer (SCM_RIGHTS) are appended there; the caller owns them. `probe`
        False: a late answer sends no liveness probe (a call the daemon may rightly hold)."""
        self._check_open()
        req_id = next(self._ids)
        body = self._packer.pack({"id": req_id, "method": method, "params": params or {}})
        return self._exchange(HEADER.pack(len(body)) + body, req_id, method, timeout_s, fds, on_late, probe)

    def call_blob(self, request: BlobRequest, blob: bytes, timeout_s: float | None = None, *,
                  on_late: LateHandler | None = None) -> Any:
        """`call(request.method, {**request.fixed, <its blob key>: blob})` with the frame
        spliced from a prebuilt template (rpc/framing.py): the engine's `match`."""
        self._check_open()
        req_id = next(self._ids)
        return self._exchange(request.frame(req_id, blob), req_id, request.method, timeout_s, None, on_late, True)

    def _exchange(self, frame: bytes, req_id: int, method: str, timeout_s: float | None,
                  fds: list[int] | None, on_late: LateHandler | None, probe: bool) -> Any:
        """Send a request's frame, read up to its answer: the result, or its refusal raised.
        Every waited call's round trip, so the common case (one send; the whole answer
        alone in one recv, nothing else buffered) takes few calls and no copies."""
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = _monotonic() + t
        self._send_frame(frame)
        reader = self._reader
        msg = None
        if fds is None and not reader.buffered and not self._outbox.data:
            msg = reader.quick(deadline)
            if msg is not None and (msg.get("id") != req_id or "event" in msg):
                reader.start = 0  # another message came first: read it again on the general path
                msg = None
        if msg is None:
            msg = self._await(req_id, deadline, fds)
        if msg is None:
            self._give_up(req_id, method, on_late, probe)
            raise DaemonSlow(f"no answer to {method} in {t:g}s (the daemon is busy or hung); a miss, the "
                             "connection is kept")
        self.ledger.answered(req_id)
        self._flush_undo()
        if "error" in msg:
            err = msg["error"]
            raise ClientError(str(err.get("code")), str(err.get("message")))
        return msg.get("result")

    def call_many(self, calls: Sequence[tuple[str, dict[str, Any] | None]], timeout_s: float | None = None, *,
                  on_late: LateHandler | None = None) -> list[Any]:
        """Several requests, pipelined: their frames go out together and their answers are
        read as they come, so the batch costs one round trip. One deadline, `timeout_s`,
        covers the whole batch. Each place of the result list holds the result, the
        refusal (a ClientError), or DaemonSlow for a request not answered in time (given
        up: `on_late` gets its answer) or not sent because the deadline passed first.
        Frames go in windows of at most MAX_PIPELINED requests and PIPELINE_BYTES, each
        answered before the next is sent: the daemon stops reading a connection whose
        answers are not read. For methods answered without descriptors."""
        self._check_open()
        deadline = _monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        results: list[Any] = []
        todo = list(calls)
        while len(results) < len(todo):
            if _monotonic() >= deadline:
                results += [DaemonSlow("not sent: the batch's deadline passed")] * (len(todo) - len(results))
                break
            window: list[bytes] = []
            sent: list[Pending] = []
            size = 0
            for method, params in todo[len(results):len(results) + MAX_PIPELINED]:
                req_id = next(self._ids)
                frame = pack_frame({"id": req_id, "method": method, "params": params or {}}, self._packer)
                if window and size + len(frame) > PIPELINE_BYTES:
                    break
                window.append(frame)
                size += len(frame)
                sent.append(self.ledger.track(req_id, method, deadline))
            self._send_frame(b"".join(window))
            self._wait_all(sent, deadline)
            for p in sent:
                if p.done:
                    results.append(p.outcome)
                else:
                    del self.ledger.pending[p.req_id]
                    self._give_up(p.req_id, p.method, on_late, True)
                    results.append(DaemonSlow(f"no answer to {p.method} in time"))
            if not all(p.done for p in sent):
                results += [DaemonSlow("not sent: the batch's deadline passed")] * (len(todo) - len(results))
        self._flush_undo()
        return results

    # -- calls answered later ------------------------------------------------------------
    def send(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = None
             ) -> Pending:
        """Send a request without waiting: its answer is read by a later `poll` (or any other
        read) into the Pending returned. Past `timeout_s` without an answer it is overdue:
        a liveness probe goes out, the call stays (the caller may `abandon` it)."""
        self._check_open()
        req_id = next(self._ids)
        self._send_frame(pack_frame({"id": req_id, "method": method, "params": params or {}}, self._packer))
        return self.ledger.track(req_id, method, _monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def send_blob(self, request: BlobRequest, blob: bytes, timeout_s: float | None = None) -> Pending:
        """`send` of a request spliced from a template (as `call_blob`)."""
        self._check_open()
        req_id = next(self._ids)
        self._send_frame(request.frame(req_id, blob))
        return self.ledger.track(req_id, request.method,
                                 _monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def send_many(self, calls: Sequence[tuple[str, dict[str, Any] | None]], timeout_s: float | None = None
                  ) -> list[Pending]:
        """`send` of several requests in one write."""
        self._check_open()
        due = _monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        frames, ids = [], []
        for method, params in calls:
            req_id = next(self._ids)
            frames.append(pack_frame({"id": req_id, "method": method, "params": params or {}}, self._packer))
            ids.append((req_id, method))
        self._send_frame(b"".join(frames))
        return [self.ledger.track(req_id, method, due) for req_id, method in ids]

    def poll(self) -> None:
        """Read and dispatch whatever has arrived, without waiting; flush queued sends (unless
        corked); send
        a liveness probe when a sent call is overdue. DaemonUnavailable when the
        connection is dead (the peer closed it, or it answered no probe in `liveness_s`)."""
        self._check_open()
        reader = self._reader
        if not self.corked:
            self._outbox.flush()
        while True:
            msg = reader.take()
            if msg is None:
                if not reader.receive(None, None):
                    break
                continue
            self.ledger.dispatch(msg, self.events)
        if self.ledger.probe_needed(_monotonic()):
            self._start_probe()
        self._flush_undo()

    def abandon(self, p: Pending, on_late: LateHandler | None = None) -> None:
        """The caller no longer wants `p`'s answer: `on_late` gets it (now, if it came)."""
        if not self.closed:
            self.ledger.abandon(p, on_late)
            self._flush_undo()

    # -- calls whose answer nobody needs ------------------------------------------------
    def post(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = None) -> None:
        """Send a request and return without waiting: for calls whose answer the caller
        does not need (a pin's release, a finished put), so a slow daemon costs the engine's
        step nothing. The daemon handles a connection's requests in order, so a later call
        sees the posted one done. It answers a posted request (`noreply`) only to refuse
        it; whichever read comes next logs that. Past MAX_POSTED posts not known handled,
        a `sync` goes out (not waited for) whose answer settles them."""
        self.post_many([(method, params)])

    def post_many(self, calls: Sequence[tuple[str, dict[str, Any] | None]]) -> None:
        """`post` of several requests in one write."""
        self._check_open()
        self._post(calls)

    def _post(self, calls: Sequence[tuple[str, dict[str, Any] | None]]) -> None:
        frames = []
        posted = self.ledger.posted
        for method, params in calls:
            req_id = next(self._ids)
            frames.append(pack_frame({"id": req_id, "method": method, "params": params or {}, "noreply": True},
                                     self._packer))
            posted[req_id] = method
        self._send_frame(b"".join(frames))
        if len(posted) >= MAX_POSTED and self.ledger.settle is None:
            self.ledger.settle = self.send("sync", None, self.liveness_s)

    def wait_posted(self, timeout_s: float | None = None) -> None:
        """Return once the daemon has handled every posted request (for callers that next
        ask the daemon something on another connection): one `sync` round trip, whose
        answer comes after any refusal of them."""
        if not self.ledger.posted:
            return
        try:
            self.call("sync", None, timeout_s)
        except ClientError as e:
            if isinstance(e, DaemonUnavailable):
                raise
            self.ledger.posted.clear()  # a daemon without `sync` refused it, after the earlier ones all the same

    def read_event(self) -> dict:
        """The next event (a subscription's connection), within the default timeout."""
        if self.events:
            return self.events.popleft()
        deadline = _monotonic() + self.timeout_s
        while True:
            msg = self._next_message(deadline, None)
            if msg is None:
                self._lost(f"no event in {self.timeout_s:g}s", None)
            if "event" in msg:
                return msg["event"]
            self.ledger.dispatch(msg, self.events)

    def close(self) -> None:
        if not self.closed:
            hook, self.on_close = self.on_close, None
            if hook is not None:
                try:
                    hook()
                except Exception:  # the connection must close whatever the hook does
                    log.exception("on_close hook failed")
            self.closed = True
            self.ledger.undo = []
            try:
                self.sock.close()
            except OSError:
                pass

    # -- internals -------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise DaemonUnavailable("connection closed")
        if self.ledger.dead(_monotonic()):
            self._lost(f"no answer to a liveness probe in {self.liveness_s:g}s (the daemon is hung)", None)

    def _lost(self, why: str, exc: BaseException | None) -> NoReturn:
        self.close()
        raise DaemonUnavailable(why) from exc

    def _give_up(self, req_id: int, method: str, on_late: LateHandler | None, probe: bool) -> None:
        """A call's deadline passed: its answer goes to `on_late`; the daemon is probed."""
        self.ledger.give_up(req_id, method, on_late)
        if probe:
            self._start_probe()

    def _start_probe(self) -> None:
        if self.ledger.probe is None and not self.closed:
            self.ledger.probe = self.send("sync", None, self.liveness_s)

    def _flush_undo(self) -> None:
        """Post what the late answers' handlers asked for (never from inside a read)."""
        if self.ledger.undo and not self.closed:
            self._post(self.ledger.take_undo())

    def _await(self, req_id: int, deadline: float, fds: list[int] | None) -> dict | None:
        """Read up to the answer to `req_id` (None when the deadline passes first),
        dispatching what comes before it."""
        while True:
            msg = self._next_message(deadline, fds)
            if msg is None:
                return None
            if msg.get("id") == req_id and "event" not in msg:
                return msg
            self.ledger.dispatch(msg, self.events)

    def _wait_all(self, pendings: list[Pending], deadline: float) -> None:
        """Read until every one of `pendings` is answered, or the deadline passes."""
        for p in pendings:
            while not p.done:
                msg = self._next_message(deadline, None)
                if msg is None:
                    return
                self.ledger.dispatch(msg, self.events)

    def _next_message(self, deadline: float, fds: list[int] | None) -> dict | None:
        """The next message, waiting until `deadline` (None when it passes first). While
        frames wait in the outbox, the wait also sends them as the socket takes them."""
        reader = self._reader
        while True:
            msg = reader.take()
            if msg is not None:
                return msg
            if self._outbox.data:
                if not self._outbox.wait(deadline):
                    return None
                reader.receive(None, fds)  # whatever came, without waiting
            elif not reader.receive(deadline, fds):
                return None

    def _send_frame(self, data: bytes) -> None:
        self._outbox.push(data)

    def flush(self) -> None:
        """Send what waits in the outbox, as far as the socket takes it now (a corked
        connection's frames)."""
        if not self.closed:
            self._outbox.flush()

    def _read_message(self, fds: list[int] | None = None) -> dict:
        """The next message within the default timeout, else the connection ends (tests)."""
        msg = self._next_message(_monotonic() + self.timeout_s, fds)
        if msg is None:
            self._lost("no message in time", None)
        return msg


def _connect_failure(path: str, e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return f"no socket at {path}"
    if isinstance(e, ConnectionRefusedError):
        return f"nothing listens on {path} (a stale socket of a daemon that died?)"
    return f"cannot connect to {path}: {e.strerror or e}"


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
