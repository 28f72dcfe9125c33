"""A request's lookup on vLLM's scheduler thread, without a daemon round trip on the step.

vLLM asks the connector how many of a new request's tokens it can load
(`get_num_new_matched_tokens`) and may be answered "ask again" (None): the request
waits this step and vLLM asks again the next. The first ask sends the request's
`match` to every namespace rank and answers "ask again"; later asks read what has
arrived (a non-blocking poll) and answer from it. So a lookup costs the step a
hash of the request's pages and a write, never a wait; a miss costs the request one
step of queueing, and a hit's pages are pinned before vLLM counts on them. When a
part of the prefix is on disk or in the remote store, a `load` (until the daemon has
it all on host) is sent the same way, and asked again for.

How long a request waits for an answer is bounded by what the answer can save:
the time the engine takes to compute the tokens it would cover (the scheduler's
measured rate, or `prefill_tokens_per_s`), never by a fixed deadline. Past it the
lookup is given up (its answer, when it comes, is given back: a pin released) and
vLLM computes the request, as it would have without hicache.

Offered tokens: every full page the ranks all hold on host, but never the prompt's
last token (vLLM must compute one), so a block-aligned prompt whose pages are all
cached loads them all and computes its last token again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache.client.asks import PENDING, Ask
from hicache.client.client import HiCacheClient, Match
from hicache.client.prefill_rate import PrefillRate

log = logging.getLogger(__name__)



@dataclass(slots=True, eq=False)
class Lookup:
    """One request's lookup: the calls in flight per rank, then what they answered."""

    started: float
    n_pages: int  # the request's full pages when asked
    asks: dict[int, Ask] = field(default_factory=dict)  # in flight: match, then load
    matches: dict[int, Match] = field(default_factory=dict)  # answered (their pins held)
    loading: bool = False  # `asks` are loads of a disk / remote part
    wait_until: float = 0.0  # give up on the asks in flight after this
    miss: bool = False  # answered: nothing to load


class StepRate:
    """Tokens per second of the engine's steps, timed between two `build_connector_meta`
    calls (the previous step's scheduled tokens over the time it took): what a lookup's
    answer can save, in seconds, is its tokens at this rate."""

    def __init__(self, configured: float | None) -> None:
        self.rate = PrefillRate(configured)
        self._last: tuple[float, int] | None = None

    def step(self, scheduled_tokens: int) -> None:
        now = time.monotonic()
        last, self._last = self._last, (now, scheduled_tokens)
        if last is not None and last[1] > 0:
            self.rate.add(last[1], now - last[0])

    def seconds(self, tokens: int) -> float:
        """How long a lookup covering `tokens` is worth waiting for (PrefillRate.worth_waiting_s)."""
        return self.rate.worth_waiting_s(tokens)


class Lookups:
    """The lookups of the scheduler's requests (one Lookup per waiting request)."""

    def __init__(self, clients: Mapping[int, HiCacheClient], page_size: int, rate: StepRate) -> None:
        self.clients = clients
        self.page_size = page_size
        self.rate = rate
        self.given_up = 0  # lookups whose answer did not come in the time it could save
        self.asked_again = 0  # "ask again" answers

    def start(self, keys: dict[int, list[bytes]], n_pages: int, local: int) -> Lookup:
        now = time.monotonic()
        lk = Lookup(now, n_pages)
        lk.asks = {r: c.ask_match(keys[r]) for r, c in self.clients.items()}
        lk.wait_until = now + self.rate.seconds((n_pages - local) * self.page_size)
        return lk

    def advance(self, lk: Lookup, local: int) -> bool:
        """Fold in what has arrived; True when the lookup has its answer (`lk.matches`
        final, or `lk.miss`), False to ask again. The caller polled the clients."""
        while lk.asks:
            answers = {r: self.clients[r].answer(a) for r, a in lk.asks.items()}
            if any(a is PENDING for a in answers.values()):
                if time.monotonic() < lk.wait_until:
                    self.asked_again += 1
                    return False
                self._give_up(lk)
                return True
            lk.asks = {}
            if not lk.loading:
                lk.matches = answers
                if any(m.pin is None or m.device_len for m in answers.values()):  # away (or a device part)
                    lk.miss = True
                    return True
                self._load_rest(lk, local, first=True)
            else:  # a daemon that answers before its reads end (its load policy) is asked again
                self._load_rest(lk, local, first=False)
        return True

    def _load_rest(self, lk: Lookup, local: int, *, first: bool) -> None:
        """Ask for the disk / remote parts beyond host, for as long as they save compute."""
        behind = [r for r, m in lk.matches.items() if m.disk_len or m.pending]
        lk.loading = bool(behind)
        if not behind:
            return
        now = time.monotonic()
        if first:
            hit = min(m.host_len for m in lk.matches.values())
            ahead = max(0, max(m.host_len + m.disk_len for m in lk.matches.values()) - max(hit, local))
            lk.wait_until = now + self.rate.seconds(max(ahead, 1) * self.page_size)
        elif now >= lk.wait_until:
            lk.loading = False
            return
        lk.asks = {r: self.clients[r].ask_load(lk.matches[r]) for r in behind}

    def _give_up(self, lk: Lookup) -> None:
        """The answers in flight would come too late to save anything: given back when they
        come. A match then is a miss; a load leaves what reached host by the match."""
        self.given_up += 1
        for r, a in lk.asks.items():
            self.clients[r].drop(a)
        lk.asks = {}
        if not lk.loading:
            lk.miss = True
        lk.loading = False

    def release(self, lk: Lookup) -> None:
        """Drop what is in flight and unpin what was answered."""
        for r, a in lk.asks.items():
            self.clients[r].drop(a)
        lk.asks = {}
        for r, m in lk.matches.items():
            self.clients[r].release(m, wait=False)
        lk.matches = {}

    def offer(self, lk: Lookup, num_tokens: int, local: int) -> tuple[int, int, int]:
        """(tokens vLLM may take, first page, end page) of a finished lookup: the pages every
        rank holds on host beyond vLLM's own `local` pages, short of the last token."""
        if lk.miss or not lk.matches:
            return 0, local, local
        hit = min(min(m.host_len for m in lk.matches.values()), lk.n_pages)
        tokens = min(hit * self.page_size, num_tokens - 1) - local * self.page_size
        if hit <= local or tokens <= 0:
            return 0, local, local
        return tokens, local, hit

    def stats(self) -> dict[str, Any]:
        return {"given_up": self.given_up, "asked_again": self.asked_again}
