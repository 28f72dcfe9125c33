"""An engine process running the hybrid reference model through a real daemon.

Each op serves one request: lookup (KV pages + the state checkpoint restored
into a private slot), prefill of the rest with state snapshots at the
checkpoint positions, store (KV and checkpoints), release. Then it recomputes
the whole request from scratch, privately, and reports whether the cached path
gave bitwise the same logits, and whether the restored state's bytes equal the
recomputed state at that position.

Ops: `blocks:1,3` (256 copies of token 1, then of token 3, then one trailing
token: an engine always computes at least one token) or `seq:SEED:N[:EVERY]`
(N random tokens; with EVERY, a checkpoint offered at every multiple of EVERY,
like chunked prefill) or `mix:SEED_A:SHARED:SEED_B:N` (the first SHARED tokens of
seq SEED_A, then others).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run as a script, this file's directory heads sys.path: put the checkout it belongs to
# before any installed hicache, so a worktree's tests drive that worktree's code.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache.client.client import HiCacheClient
from hicache.client.hybrid_cache import HybridEngineCache
from hicache.engine.attention import ForwardBatch
from hicache.engine.hybrid_model import HybridConfig, HybridModel
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.device.state_pool import StatePool

PS = 16
BLOCK = 256
TRAILING_TOKEN = 7


def request_tokens(op: str) -> tuple[np.ndarray, int | None]:
    kind, *args = op.split(":")
    if kind == "blocks":
        ids = [int(x) for x in args[0].split(",")]
        return np.r_[np.repeat(np.asarray(ids, dtype=np.int64), BLOCK), [TRAILING_TOKEN]], None
    if kind == "seq":
        seed, n = int(args[0]), int(args[1])
        every = int(args[2]) if len(args) > 2 else None
        return np.random.default_rng(seed).integers(0, 512, n), every
    if kind == "mix":  # the first SHARED tokens of seq SEED_A, then tokens of seed SEED_B
        seed_a, shared, seed_b, n = (int(x) for x in args)
        head = np.random.default_rng(seed_a).integers(0, 512, shared)
        return np.r_[head, np.random.default_rng(seed_b).integers(0, 512, n - shared)], None
    raise ValueError(f"unknown op {op!r}")


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.model = HybridModel(HybridConfig())
        layout = self.model.kv_layout(PS)
        self.pool = DevicePool(layout, num_slots=args.pool_pages * PS)
        self.alloc = PagedTokenToKVPoolAllocator(self.pool.num_slots, PS)
        self.states = StatePool(self.model.state_layout(args.chunk), 32)
        client = HiCacheClient(layout, self.pool.num_pages, model="hybrid-test", socket_path=args.socket,
                               timeout_s=30.0, backoff_s=(0.02, 0.2), state=self.states.layout)
        self.cache = HybridEngineCache(client, self.pool, self.alloc, self.states)

    def slots_of(self, pages: np.ndarray) -> torch.Tensor:
        p = torch.from_numpy(np.asarray(pages, dtype=np.int64))
        return (p[:, None] * PS + torch.arange(PS)).reshape(-1)

    def blob(self, slot: int) -> np.ndarray:
        out = np.zeros(self.states.layout.checkpoint_bytes, dtype=np.uint8)
        self.states.write_to(slot, out)
        return out

    def serve(self, op: str) -> dict:
        tokens, every = request_tokens(op)
        ids = torch.from_numpy(tokens)
        n = len(tokens)
        cache, states = self.cache, self.states
        hp = cache.lookup(tokens)
        start = hp.length
        restored = self.blob(hp.state_slot) if start else None
        new_pages = cache.kv.alloc_pages(-(-(n - start) // PS))
        seq_slots = torch.cat([self.slots_of(hp.device_pages), self.slots_of(new_pages)])[:n]
        full = n - n % PS
        if every is None:
            positions = cache.checkpoint_positions(hp, n)
        else:
            positions = [p for p in range(every, full + 1, every) if p > start]
        snaps = states.alloc(len(positions))
        offered = dict(zip(positions, snaps))
        logits = self.model.forward(ForwardBatch.build([ids[start:]], [seq_slots]), self.pool, states,
                                    [hp.state_slot], snapshots=[offered], layer_hook=hp.wait_layer, all_logits=True)
        cache.finish_load(hp)
        stored = cache.store(hp, tokens, new_pages, offered)
        states.free(snaps)
        sm = hp.kv.match.state
        cache.release(hp)
        self.drain_backups()
        # the same request recomputed from scratch, privately
        ref_pages = cache.kv.alloc_pages(-(-n // PS))
        ref_slot, ref_snap = states.alloc(2)
        ref = self.model.forward(ForwardBatch.build([ids], [self.slots_of(ref_pages)[:n]]), self.pool, states,
                                 [ref_slot], snapshots=[{start: ref_snap} if start else {}], all_logits=True)
        exact = torch.equal(logits, ref[start:])
        state_exact = None if restored is None else bool(np.array_equal(restored, self.blob(ref_snap)))
        self.alloc.free(self.slots_of(ref_pages))
        states.free([ref_slot, ref_snap])
        return {"op": op, "usable": start, "kv_len": None if sm is None else sm.kv_len,
                "fork_at": None if sm is None else sm.fork_at, "offered": positions, "stored": stored,
                "exact": exact, "state_exact": state_exact, "connected": cache.client.connected}

    def drain_backups(self) -> None:
        deadline = time.monotonic() + 20
        while self.cache.kv.backups and time.monotonic() < deadline:
            self.cache.kv.poll()
            time.sleep(0.005)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--pool-pages", type=int, default=512)
    p.add_argument("--interactive", action="store_true", help="read ops from stdin, one per line")
    p.add_argument("ops", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(1)
    worker = Worker(args)
    ops = args.ops if not args.interactive else (line.strip() for line in sys.stdin)
    for op in ops:
        if not op:
            continue
        if op == "quit":
            break
        print(json.dumps(worker.serve(op)), flush=True)
    worker.cache.close()


if __name__ == "__main__":
    main()
