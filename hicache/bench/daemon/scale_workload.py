"""The engine side of `hicache bench scale`: conversations stored on the vLLM connector's path.

One engine process (HiCacheClient with the default deadlines, as the connector
has them) keeps `in_flight` requests going. A request is one turn of a
conversation: its prompt is a shared system prompt (one of `system_prompts`, 8
pages), the turns before it and `turn_pages` new pages. Each step does what
the connector's scheduler does for that many requests (hicache/integrations/
vllm/scheduler.py): a `match` per request (the lookup; the pin is released,
posted), one pipelined `put_many` for all of them, the copies into the arena
slots it returned, and a posted `put_done` each. A finished conversation makes
room for a new one.

Every page is 512 bytes of 16 tokens: a tiny KV geometry, so the per-page costs
of the daemon dominate and a million pages fit a small machine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from hicache.client.client import CallDeadlines, HiCacheClient
from hicache.index.keys import page_keys
from hicache.layout import KVLayout

# 2 (K, V) x 16 tokens x 1 head x 8 dims x 2 bytes = 512 bytes per page
LAYOUT = KVLayout("mha", num_layers=1, page_size=16, dtype="float16", num_kv_heads=1, head_dim=8)
MODEL = "bench-scale"
SYSTEM_PAGES = 8
SAMPLED_PROMPTS = 4096  # prompts kept (reservoir) for the match timings


@dataclass(slots=True)
class Workload:
    system_prompts: int = 300
    turns: tuple[int, int] = (1, 4)  # per conversation, inclusive
    turn_pages: tuple[int, int] = (4, 28)  # new pages per turn, inclusive
    in_flight: int = 32
    seed: int = 0


@dataclass(slots=True)
class _Conversation:
    system: int  # its system prompt
    turns_left: int
    tokens: np.ndarray  # the prompt so far (whole pages)
    keys: list[bytes]
    stored: int = 0  # of its pages after the system prompt, how many a put stored (once at least)


@dataclass(slots=True)
class FillReport:
    """What the engine saw while filling; the daemon's side is read from its stats."""

    steps: int = 0
    requests: int = 0
    put_pages: int = 0  # pages the daemon reserved and this engine copied and reported done
    distinct_pages: int = 0  # of them, pages never stored before (a page the host evicted may be put again)
    seconds: float = 0.0
    match_s: list[float] = field(default_factory=list)  # every lookup's round trip during the fill
    skipped_puts: int = 0  # puts not answered: the daemon away or late
    refused_puts: int = 0  # puts the daemon answered without pages: no host room for them
    uncovered: int = 0  # plans whose slabs could not be mapped (reported failed)
    outages: int = 0  # times the client's breaker opened: a connection given up (liveness), a refused hello
    late: int = 0  # waited calls past their deadline (a miss or a skipped store; the connection stays)
    misses_while_away: int = 0
    refusals: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why the breaker opened, by message
    late_reasons: dict[str, int] = field(default_factory=dict)  # what went late, by the client's message


class _Reasons(logging.Handler):
    """Counts the client's 'daemon unavailable (why)' warnings (outages) and 'daemon slow
    (why)' warnings (the first late call of a slow spell) by their reason."""

    def __init__(self, outages: dict[str, int], late: dict[str, int]) -> None:
        super().__init__(logging.WARNING)
        self.by_kind = (("unavailable (", outages), ("slow (", late))

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for marker, into in self.by_kind:
            if marker in msg:
                why = msg.split(marker, 1)[1].split(")", 1)[0]
                into[why] = into.get(why, 0) + 1


class Engine:
    """A connector-like engine filling the daemon (see the module docstring)."""

    def __init__(self, socket_path: str, workload: Workload, deadlines: CallDeadlines | None = None) -> None:
        """`deadlines`: the client's (default: the connector's own, so a late answer is an
        outage the report counts)."""
        self.w = workload
        self.client = HiCacheClient(LAYOUT, 1 << 16, model=MODEL, socket_path=socket_path, deadlines=deadlines)
        self.rng = np.random.default_rng(workload.seed)
        ps = LAYOUT.page_size
        self.systems = self.rng.integers(1, 1 << 30, (workload.system_prompts, SYSTEM_PAGES * ps), dtype=np.int32)
        self.system_keys: list[list[bytes]] = [page_keys(self.client.salt, t, ps) for t in self.systems]
        self.active: list[_Conversation] = []
        self._systems_stored: set[int] = set()
        self.sampled: list[list[bytes]] = []  # prompts' keys (reservoir) for match timings
        self._seen_prompts = 0
        self.pattern = self.rng.integers(0, 256, (64, LAYOUT.page_bytes), dtype=np.uint8)
        self.report = FillReport()
        self._log_handler = _Reasons(self.report.reasons, self.report.late_reasons)
        logging.getLogger("hicache.client").addHandler(self._log_handler)

    def connect(self) -> None:
        if not self.client.connect():
            raise RuntimeError(f"cannot connect to the daemon at {self.client.socket_path}")

    def close(self) -> None:
        logging.getLogger("hicache.client").removeHandler(self._log_handler)
        self.client.close()

    # -- the workload -------------------------------------------------------------------
    def _new_conversation(self) -> _Conversation:
        s = int(self.rng.integers(self.w.system_prompts))
        lo, hi = self.w.turns
        return _Conversation(s, int(self.rng.integers(lo, hi + 1)), self.systems[s], list(self.system_keys[s]))

    def _next_turn(self, c: _Conversation) -> None:
        lo, hi = self.w.turn_pages
        ps = LAYOUT.page_size
        new = self.rng.integers(1, 1 << 30, int(self.rng.integers(lo, hi + 1)) * ps, dtype=np.int32)
        c.keys = c.keys + page_keys(self.client.salt, new, ps, parent=c.keys[-1])
        c.tokens = np.concatenate([c.tokens, new])
        c.turns_left -= 1
        self._sample(c.keys)

    def _sample(self, keys: list[bytes]) -> None:
        self._seen_prompts += 1
        if len(self.sampled) < SAMPLED_PROMPTS:
            self.sampled.append(keys)
            return
        j = int(self.rng.integers(self._seen_prompts))
        if j < SAMPLED_PROMPTS:
            self.sampled[j] = keys

    # -- the connector's path -------------------------------------------------------------
    def step(self) -> int:
        """One scheduler step over `in_flight` requests; the pages stored."""
        while len(self.active) < self.w.in_flight:
            self.active.append(self._new_conversation())
        for c in self.active:
            self._next_turn(c)
        client, r = self.client, self.report
        for c in self.active:  # the lookups, one round trip each, as the scheduler makes them
            t0 = time.perf_counter()
            m = client.match(keys=c.keys)
            r.match_s.append(time.perf_counter() - t0)
            client.release(m, wait=False)
        plans = client.put_many([(c.tokens, c.keys) for c in self.active])
        stored = 0
        arena = client.arena
        for c, plan in zip(self.active, plans):
            if plan is None:
                r.skipped_puts += 1
                continue
            if plan.put is None:
                r.refused_puts += plan.present < len(c.keys)
                continue
            slots = plan.host_pages
            if arena is None or not arena.covers(slots, LAYOUT.page_bytes):
                r.uncovered += 1
                client.put_done(plan, False, wait=False)
                continue
            rows = arena.array[:(int(slots.max()) + 1) * LAYOUT.page_bytes].reshape(-1, LAYOUT.page_bytes)
            rows[slots] = self.pattern[slots % len(self.pattern)]  # the copies of the step's new blocks
            client.put_done(plan, True, wait=False)
            stored += len(slots)
            own = len(c.keys) - SYSTEM_PAGES  # the put stored all of them (or had them on host)
            r.distinct_pages += own - c.stored
            c.stored = own
            if c.system not in self._systems_stored and plan.present < SYSTEM_PAGES:
                self._systems_stored.add(c.system)
                r.distinct_pages += SYSTEM_PAGES
        self.active = [c for c in self.active if c.turns_left > 0]
        r.steps += 1
        r.requests += len(plans)
        r.put_pages += stored
        return stored

    def fill(self, pages: int, until_s: float | None = None) -> int:
        """Steps until `pages` more pages were stored (or `until_s`, monotonic, passed)."""
        done = 0
        t0 = time.monotonic()
        while done < pages and (until_s is None or time.monotonic() < until_s):
            done += self.step()
        self.report.seconds += time.monotonic() - t0
        c = self.client
        r = self.report
        r.outages, r.late, r.misses_while_away, r.refusals = c.outages, c.late, c.misses_while_away, c.refusals
        return done

    def time_matches(self, count: int) -> list[float]:
        """Round trips of `match` for sampled prompts (stored ones), each released (posted)."""
        self.client.wait_posted()
        rng = np.random.default_rng(self.w.seed + 1)
        picks = rng.integers(len(self.sampled), size=count)
        out = []
        for i in picks:
            keys = self.sampled[int(i)]
            t0 = time.perf_counter()
            m = self.client.match(keys=keys)
            out.append(time.perf_counter() - t0)
            self.client.release(m, wait=False)
        self.client.wait_posted()
        return out
