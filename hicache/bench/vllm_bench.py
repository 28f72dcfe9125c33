"""`hicache bench vllm`: a real vLLM engine serving multi-turn conversations, with and
without hicache, in one run.

Each turn of every conversation resends the whole conversation so far (a shared system
prompt, then the turns before it) plus a new user message; a turn is one `generate`
call over all conversations. Between turns vLLM's own prefix cache is cleared, as GPU
memory pressure would evict it between a user's turns -- the case hicache exists for.
Both runs are their own processes over the same tiny random Llama
(hicache/bench/tiny_llama.py) and the same token ids; the rows compare time to first
token and the prefill tokens vLLM had to compute.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from hicache.bench.report import row
from hicache.bench.tiny_llama import build_tiny_llama
from hicache.daemon.launcher import LocalDaemon
from hicache.integrations.vllm_driver import run_in_process


def conversations(n: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
                  seed: int = 0) -> list[list[list[int]]]:
    """rounds[t][c]: the prompt of conversation c at turn t."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(1, 500) for _ in range(k)]  # noqa: E731
    system = tok(system_tokens)
    history = [list(system) for _ in range(n)]
    rounds = []
    for _ in range(turns):
        prompts = []
        for h in history:
            h += tok(user_tokens)
            prompts.append(list(h))
            h += tok(reply_tokens)  # the assistant's answer, as the client resends it next turn
        rounds.append(prompts)
    return rounds


def _run(spec: dict, workdir: Path, name: str) -> dict:
    try:
        return run_in_process(spec, workdir, name)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def run(args: argparse.Namespace) -> list[dict]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-vllm-"))
    model = build_tiny_llama(workdir / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads)
    rounds = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                           args.reply_tokens)
    spec = {"model": str(model), "block_size": args.block_size, "max_tokens": args.max_tokens,
            "rounds": rounds, "max_model_len": 4096, "kv_cache_bytes": 256 << 20}
    base = _run({**spec, "socket": None}, workdir, "without")
    with LocalDaemon(workdir / "daemon", "--host-capacity", "1GiB", "--no-disk") as daemon:
        mine = _run({**spec, "socket": daemon.socket}, workdir, "with")
    if [r["outputs"] for r in mine["rounds"]] != [r["outputs"] for r in base["rounds"]]:
        raise SystemExit("outputs with hicache differ from those without: not a valid comparison")
    rows = []
    for label, sel in (("turn 1 (cold)", slice(0, 1)), ("turns 2+ (warm)", slice(1, None))):
        ttft_h = _mean([t for r in mine["rounds"][sel] for t in r["ttft"] if t is not None])
        ttft_b = _mean([t for r in base["rounds"][sel] for t in r["ttft"] if t is not None])
        rows.append(row(f"ttft {label}", ttft_h * 1e3, "ms", ttft_b * 1e3, "without hicache"))
        prompt = sum(len(p) for ps in rounds[sel] for p in ps)
        comp_h = prompt - sum(c for r in mine["rounds"][sel] for c in r["cached"])
        comp_b = prompt - sum(c for r in base["rounds"][sel] for c in r["cached"])
        rows.append(row(f"prefill tokens computed {label}", comp_h, "tokens", comp_b, "without hicache",
                        prompt_tokens=prompt))
        wall_h = sum(r["wall_s"] for r in mine["rounds"][sel])
        wall_b = sum(r["wall_s"] for r in base["rounds"][sel])
        rows.append(row(f"generate wall {label}", wall_h, "s", wall_b, "without hicache"))
    return rows


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--conversations", type=int, default=8)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--system-tokens", type=int, default=1024)
    b.add_argument("--user-tokens", type=int, default=96)
    b.add_argument("--reply-tokens", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=4)
    b.add_argument("--block-size", type=int, default=32)
    b.add_argument("--layers", type=int, default=8)
    b.add_argument("--hidden", type=int, default=512)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--kv-heads", type=int, default=4)
    b.add_argument("--workdir")
