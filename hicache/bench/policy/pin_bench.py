"""`hicache bench pins`: pinned prefixes under a flood of one-shot prompts (issue 29's hint goal).

One workload, replayed twice against fresh real daemons (host tier only, so the
flood is what decides): `prefixes` shared prefixes are stored, a `pinned_share`
of them (5% by default) pinned in host -- in the baseline run nobody pins --
then each round a flood of one-shot prompts, more than the host holds, passes
through before every shared prefix is asked for again (a miss stores it again).
Reported: the hit rate of the pinned prefixes with pins against the same
prefixes without (the goal: 1.0 with pins), and of the other shared prefixes,
which the pins must not cost much. Hit pages of pinned prefixes are read back
and compared with what was stored (`bad_pages`).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

import numpy as np

from hicache.bench.report import row
from hicache.client.client import HiCacheClient
from hicache.client.hints import RetainHint
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.layout import KVLayout

LAYOUT = KVLayout("mha", num_layers=4, page_size=16, dtype="float16", num_kv_heads=4, head_dim=64)  # 64 KiB pages


@dataclass(frozen=True, slots=True)
class PinWorkload:
    prefixes: int = 40         # shared prefixes, each asked for once per round
    prefix_pages: int = 4
    pinned_share: float = 0.05
    flood_prompts: int = 40    # one-shot prompts per round, each stored once and never asked for again
    flood_pages: int = 8
    rounds: int = 4
    host_capacity: str = "16MiB"  # 256 pages: the flood of a round is more than the host holds
    ttl_s: float = 3600.0

    @property
    def num_pinned(self) -> int:
        return max(1, round(self.prefixes * self.pinned_share))


@dataclass(slots=True)
class PinOutcome:
    pinned_hit_rate: float     # pages of the pinned prefixes found on host / asked for
    other_hit_rate: float      # the same for the other shared prefixes
    bad_pages: int             # hit pages of pinned prefixes whose bytes differ from what was stored
    pinned_stats: dict         # the daemon's `pinned` stats at the end


def _tokens(kind: int, i: int, pages: int) -> np.ndarray:
    """Distinct token ids per (kind, i): prompts share no page by accident."""
    n = pages * LAYOUT.page_size
    return (np.arange(n, dtype=np.int64) + (kind * 1_000_000 + i * 10_000)).astype(np.int32)


def _pattern(key: bytes) -> np.ndarray:
    pb = LAYOUT.page_bytes
    return np.frombuffer((key * (pb // len(key) + 1))[:pb], dtype=np.uint8)


def _store(c: HiCacheClient, toks: np.ndarray) -> None:
    keys = c.page_keys(toks)
    plan = c.put(toks, keys=keys)
    if plan is None or plan.put is None:
        return
    arena, pb = c.arena, LAYOUT.page_bytes
    assert arena is not None
    for key, slot in zip(keys[plan.present:], plan.host_pages):
        arena.array[int(slot) * pb:(int(slot) + 1) * pb] = _pattern(key)
    c.put_done(plan)


def replay(socket: str, w: PinWorkload, pin: bool) -> PinOutcome:
    """The workload through the daemon at `socket` (pinning the first prefixes if `pin`)."""
    c = HiCacheClient(LAYOUT, 64, model="pin-bench", socket_path=socket, timeout_s=30.0)
    if not c.connect():
        raise RuntimeError(f"no daemon at {socket}")
    try:
        shared = [_tokens(1, i, w.prefix_pages) for i in range(w.prefixes)]
        for toks in shared:
            _store(c, toks)
        if pin:
            hint = RetainHint(w.ttl_s, "host")
            for toks in shared[:w.num_pinned]:
                r = c.pin(hint, toks)
                if r is None or r["pages"] != w.prefix_pages:
                    raise RuntimeError(f"pinning a stored prefix failed: {r}")
        asked = {True: 0, False: 0}
        hit = {True: 0, False: 0}
        bad = 0
        seq = 0
        for _ in range(w.rounds):
            for _ in range(w.flood_prompts):
                seq += 1
                _store(c, _tokens(2, seq, w.flood_pages))
            for i, toks in enumerate(shared):
                is_pinned = i < w.num_pinned
                m = c.match(toks)
                asked[is_pinned] += w.prefix_pages
                hit[is_pinned] += m.host_len
                if is_pinned and m.host_len:
                    arena, pb = c.arena, LAYOUT.page_bytes
                    assert arena is not None
                    for key, slot in zip(m.keys, m.host_pages):
                        bad += not np.array_equal(arena.array[int(slot) * pb:(int(slot) + 1) * pb], _pattern(key))
                c.release(m)
                if m.host_len < w.prefix_pages:
                    _store(c, toks)
        st = c.stats()["pinned"]
    finally:
        c.close()
    return PinOutcome(hit[True] / max(1, asked[True]), hit[False] / max(1, asked[False]), bad, st)


def measure(w: PinWorkload, workdir: str | None = None) -> tuple[PinOutcome, PinOutcome]:
    """(with pins, without): the same workload against two fresh daemons."""
    out = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for pin in (True, False):
            with LocalDaemon(f"{tmp}/{'pins' if pin else 'none'}", "--host-capacity", w.host_capacity,
                             "--no-disk") as d:
                out.append(replay(d.socket, w, pin))
    return out[0], out[1]


def add_arguments(b: argparse.ArgumentParser) -> None:
    w = PinWorkload()
    b.add_argument("--prefixes", type=int, default=w.prefixes)
    b.add_argument("--pinned-share", type=float, default=w.pinned_share)
    b.add_argument("--flood-prompts", type=int, default=w.flood_prompts, help="one-shot prompts per round")
    b.add_argument("--rounds", type=int, default=w.rounds)


def run(args: argparse.Namespace) -> list[dict]:
    w = PinWorkload(prefixes=args.prefixes, pinned_share=args.pinned_share, flood_prompts=args.flood_prompts,
                    rounds=args.rounds)
    pinned, plain = measure(w)
    note = f"{w.num_pinned} of {w.prefixes} prefixes pinned, {w.flood_prompts} one-shot prompts per round"
    return [
        row("hit rate of the pinned prefixes, pinned", pinned.pinned_hit_rate, "ratio", plain.pinned_hit_rate,
            "not pinned", note=note, bad_pages=pinned.bad_pages),
        row("hit rate of the other shared prefixes", pinned.other_hit_rate, "ratio", plain.other_hit_rate,
            "no pins at all"),
    ]
