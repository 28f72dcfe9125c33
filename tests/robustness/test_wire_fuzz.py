"""Wire fuzzing: seeded hostile frames across every RPC method against a real daemon.

After every connection's frames, the daemon must still be running, answer a fresh
client's `stats` promptly, and must never have answered INTERNAL (which means input
reached a handler unvalidated: the assertion names the method and parameters).
CI runs a fixed seed and a count that takes about a minute on a loaded 2-core
machine; `--long` runs >= 100k frames.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

import pytest

from hicache.daemon.serve.handlers import build_handlers
from hicache.kernels.native_build import sanitizers

from tests.robustness.contracts import HELLO_REQUIRED, INTERNAL, error_code
from tests.robustness.fuzz_frames import METHODS, Context, Frame, FrameFuzzer
from tests.robustness.proc import cap_address_space, memory_kib
from tests.robustness.wire import RawConn, WireError, exchange, served_stats

# Each test runs on both of the daemon's frame loops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("frame_loop")

SEED = 1405
CI_FRAMES = 12_000
LONG_FRAMES = 120_000
REPLY_TIMEOUT_S = 30.0  # generous: a loaded CI machine; a stalled loop never answers at all
HEALTH_TIMEOUT_S = 10.0


class _Shell:
    """Stands in for the Daemon while build_handlers only collects its closures."""

    def __getattr__(self, name: str) -> Any:
        return _Shell()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Shell()

    def __mul__(self, other: Any) -> Any:  # limits build_handlers derives once (e.g. the largest key blob)
        return _Shell()

    __rmul__ = __mul__


def served_methods() -> set[str]:
    return set(build_handlers(_Shell()))  # type: ignore[arg-type]


def test_the_fuzzer_knows_every_method_the_daemon_serves():
    served = served_methods()
    assert served <= set(METHODS), f"methods the fuzzer never sends: {sorted(served - set(METHODS))}"


class FuzzRun:
    def __init__(self, socket: str, seed: int) -> None:
        self.socket = socket
        self.seed = seed
        self.fuzz = FrameFuzzer(seed)
        self.rng = random.Random(seed + 1)
        self.frames = 0
        self.connections = 0
        self.replies = 0
        self.closed_after_breaker = 0
        self.closed_unprovoked = 0
        self.codes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.seen: dict[str, set[str]] = {m: set() for m in METHODS}

    def connection(self) -> list[str]:
        """One connection's worth of frames; returns the INTERNAL answers as descriptions."""
        internal: list[str] = []
        ctx = Context()
        self.connections += 1
        with RawConn(self.socket, timeout_s=REPLY_TIMEOUT_S) as conn:
            rounds = self.rng.randrange(1, 6)
            for rnd in range(rounds):
                batch: list[Frame] = []
                if rnd == 0:  # hello first, as the daemon requires; now and then not
                    batch.append(self.fuzz.hello() if self.rng.random() < 0.92 else self.fuzz.next_frame(ctx))
                batch += [self.fuzz.next_frame(ctx) for _ in range(self.rng.randrange(1, 48))]
                breaker = rnd == rounds - 1 and self.rng.random() < 0.12
                if breaker:
                    batch.append(self.fuzz.stream_breaker())
                self.frames += len(batch)
                self.kinds.update(f.kind for f in batch)
                try:
                    replies, closed = exchange(conn, b"".join(f.data for f in batch), sum(f.replies for f in batch),
                                               REPLY_TIMEOUT_S)
                except TimeoutError as e:
                    raise AssertionError(f"the daemon stopped answering ({e}); frames of that batch:\n"
                                         + "\n".join(f.describe(200) for f in batch)) from None
                by_id = {f.req_id: f for f in batch if type(f.req_id) is int}
                for reply in replies:
                    self.replies += 1
                    code = error_code(reply) or "OK"
                    self.codes[code] += 1
                    f = by_id.get(reply.get("id")) if type(reply.get("id")) is int else None
                    if f is not None and isinstance(f.method, str) and f.method in self.seen:
                        self.seen[f.method].add(code)
                    if code == INTERNAL:
                        what = f.describe() if f is not None else "(a frame without a usable id)"
                        internal.append(f"{what}\n    -> {reply['error'].get('message')!r:.300}")
                    elif f is not None and "result" in reply:
                        ctx.learn(f, reply)
                if closed:
                    if breaker:
                        self.closed_after_breaker += 1
                    else:
                        self.closed_unprovoked += 1
                    break
        return internal

    def summary(self, seconds: float, rss: tuple[dict, dict]) -> str:
        return (f"wire fuzz: seed={self.seed} frames={self.frames} connections={self.connections} "
                f"replies={self.replies} closed_after_stream_breaker={self.closed_after_breaker} "
                f"closed_unprovoked={self.closed_unprovoked} in {seconds:.1f}s; "
                f"daemon RSS {rss[0]['VmRSS']} -> {rss[1]['VmRSS']} KiB (anon {rss[0]['RssAnon']} -> "
                f"{rss[1]['RssAnon']}); codes={dict(self.codes.most_common())}; kinds={dict(self.kinds)}")


def test_fuzzed_frames_never_crash_stall_or_reach_a_handler_unvalidated(daemon_factory, long_mode, frame_loop):
    target = LONG_FRAMES if long_mode else CI_FRAMES
    d = daemon_factory("--host-capacity", "32MiB", "--disk-capacity", "64MiB").start()
    assert d.proc is not None
    cap_address_space(d.proc.pid)
    loop = served_stats(d.socket)["native"]["frame_loop"]
    assert loop["runs"] == ("native" if frame_loop == "native" else "python"), loop
    if frame_loop == "native":  # under scripts/test_sanitized.sh: the build with the sanitizers
        assert sanitizers(loop["build"]) == os.environ.get("HICACHE_SANITIZE", ""), loop
    run = FuzzRun(d.socket, SEED)
    rss_before = memory_kib(d.proc.pid)
    t0 = time.monotonic()
    while run.frames < target:
        internal = run.connection()
        assert d.running, (f"the daemon exited ({d.proc.returncode}) after {run.frames} frames:\n"
                           f"{d.read_log()[-3000:]}")
        try:
            served_stats(d.socket, HEALTH_TIMEOUT_S)
        except WireError as e:
            raise AssertionError(f"after {run.frames} fuzzed frames: {e}") from None
        assert not internal, (f"INTERNAL answers (unvalidated input reached a handler) after {run.frames} "
                              f"frames:\n" + "\n".join(internal[:10]))
    seconds = time.monotonic() - t0
    print("\n" + run.summary(seconds, (rss_before, memory_kib(d.proc.pid))))
    unserved = [m for m in sorted(served_methods()) if not run.seen.get(m, set()) - {"UNKNOWN_METHOD"}]
    assert not unserved, f"methods the fuzz never got a real answer for: {unserved}"


def test_every_method_before_hello_is_refused_and_changes_nothing(daemon_factory):
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB").start()
    before = served_stats(d.socket)
    fuzz, ctx = FrameFuzzer(SEED), Context()
    answered = {}
    with RawConn(d.socket, timeout_s=REPLY_TIMEOUT_S) as conn:
        for method in sorted(served_methods()):
            if method != "hello":
                answered[method] = error_code(conn.call(method, fuzz.valid_params(method, ctx))) or "served"
        conn.hello()  # and the connection is still usable
        assert "result" in conn.call("stats")
    after = served_stats(d.socket)
    wrong = {m: code for m, code in answered.items() if code != HELLO_REQUIRED}
    assert not wrong, f"requests before hello must get {HELLO_REQUIRED}; got {wrong}"
    assert (after["namespaces"], len(after["engines"])) == (before["namespaces"], len(before["engines"]))
