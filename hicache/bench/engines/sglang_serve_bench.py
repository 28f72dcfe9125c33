"""`hicache bench sglang-serve`: a real SGLang server on a multi-turn workload, four ways.

Each configuration is its own `python -m sglang.launch_server` process (one after
another, the same flags otherwise), serving the same conversations
(hicache.bench.engines.vllm_workload: a shared system prompt, then turns that resend
everything said so far), one request at a time, turn by turn over all
conversations:

  sglang        SGLang alone: its device radix cache.
  sglang-host   + SGLang's HiCache host tier (--enable-hierarchical-cache), `--host-ratio` x device.
  sglang-file   + SGLang's built-in `file` storage backend behind a `--ratio` x device host tier.
  hicache       + hicache (host + disk) behind the same `--ratio` x device host tier; the daemon's
                host tier is (host-ratio - ratio) x device, so sglang-host and hicache hold the
                same host memory.

The device pool (`--device-tokens`) is far smaller than the conversations, so
later turns find their history only in the slower tiers. Per configuration:
TTFT (the first streamed chunk), prefill tokens computed (prompt tokens minus
SGLang's cached tokens), throughput (prompt + output tokens over the workload's
wall time), where the cached tokens came from, and whether its greedy outputs
equal SGLang alone's, request by request (a configuration that differs is
reported as such: its numbers would measure something else).

    hicache bench sglang-serve [--conversations 16] [--turns 4] [--server-path DIR ...]

On a CPU-only machine SGLang needs stand-ins for its kernel package (no CPU build
on the registries): `--server-path` puts a directory first on the servers'
PYTHONPATH (hicache's tests have one: tests/integrations/sglang_standins).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hicache.bench.engines.tiny_llama import build_tiny_llama
from hicache.bench.engines.vllm_workload import conversations
from hicache.bench.procs.sglang_server import SGLangServer, hicache_extra_config
from hicache.bench.report import row

CONFIGS = ("sglang", "sglang-host", "sglang-file", "hicache")
BASE = "sglang"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--conversations", type=int, default=16)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--system-tokens", type=int, default=256)
    b.add_argument("--user-tokens", type=int, default=192)
    b.add_argument("--reply-tokens", type=int, default=16)
    b.add_argument("--max-tokens", type=int, default=16, help="generated per request")
    b.add_argument("--device-tokens", type=int, default=2048, help="SGLang's device KV pool (--max-total-tokens)")
    b.add_argument("--ratio", type=float, default=2.0, help="SGLang's host tier in front of a storage backend")
    b.add_argument("--host-ratio", type=float, default=4.0, help="sglang-host's host tier (equal host memory)")
    b.add_argument("--device", default="cpu", help="SGLang's --device")
    b.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    b.add_argument("--server-path", action="append", default=[],
                   help="first on the servers' PYTHONPATH (stand-ins for a CPU-only machine)")
    b.add_argument("--workdir", help="model, logs, the daemon's and the file backend's state (default: a temp dir)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DTYPE = "float16"  # every server's --dtype, so the KV's bytes per token are known here


def _kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # K and V, float16


def _stream(port: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request: TTFT, outputs, cached-token details."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    assert last is not None and ttft is not None
    meta = last["meta_info"]
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "outputs": last["output_ids"],
            "prompt_tokens": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0),
            "details": meta.get("cached_tokens_details") or {}}


def _server_args(name: str, model: Path, port: int, args: argparse.Namespace, sock: str | None) -> list[str]:
    out = ["--model-path", str(model), "--device", args.device, "--dtype", DTYPE, "--skip-tokenizer-init",
           "--page-size", "16", "--max-total-tokens", str(args.device_tokens), "--port", str(port)]
    if name == BASE:
        return out
    out += ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--hicache-ratio", f"{args.host_ratio if name == 'sglang-host' else args.ratio:g}"]
    if name == "sglang-file":
        out += ["--hicache-storage-backend", "file"]
    elif name == "hicache":
        out += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                hicache_extra_config(sock)]
    return out


def _measure(name: str, model: Path, rounds: list[list[list[int]]], args: argparse.Namespace,
             work: Path) -> dict[str, Any]:
    from hicache.daemon.serve.launcher import LocalDaemon

    daemon = None
    env: dict[str, str] = {}
    if name == "hicache":
        host_bytes = int((args.host_ratio - args.ratio) * args.device_tokens * _kv_bytes_per_token(model))
        daemon = LocalDaemon(work / "daemon", "--host-capacity", str(max(host_bytes, 1 << 20)),
                             "--disk-capacity", str(1 << 30)).start()
    if name == "sglang-file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(work / "file-backend")
    port = _port()
    server = SGLangServer(_server_args(name, model, port, args, daemon.socket if daemon else None), port,
                          work / f"{name}.log", extra_path=list(args.server_path), env=env)
    try:
        t0 = time.perf_counter()
        server.start()
        start_s = time.perf_counter() - t0
        _stream(port, [7] * 20, 1)  # warm-up: nothing of the workload
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for t, prompts in enumerate(rounds):
            for c, prompt in enumerate(prompts):
                results.append({"turn": t, "conversation": c, **_stream(port, prompt, args.max_tokens)})
        wall = time.perf_counter() - t0
    finally:
        server.stop()
        if daemon is not None:
            daemon.stop()
    return {"requests": results, "wall_s": wall, "start_s": start_s}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def rows(measured: dict[str, dict[str, Any]]) -> list[dict]:
    base = measured.get(BASE)
    out: list[dict] = []

    def summary(m: dict[str, Any]) -> dict[str, float]:
        reqs = m["requests"]
        warm = [r for r in reqs if r["turn"] > 0]
        tokens = sum(r["prompt_tokens"] + len(r["outputs"]) for r in reqs)
        return {"ttft_ms": 1e3 * _mean([r["ttft_s"] for r in reqs]),
                "warm_ttft_ms": 1e3 * _mean([r["ttft_s"] for r in warm]),
                "prefill": float(sum(r["prompt_tokens"] - r["cached"] for r in reqs)),
                "storage": float(sum(r["details"].get("storage", 0) for r in reqs)),
                "host": float(sum(r["details"].get("host", 0) for r in reqs)),
                "throughput": tokens / m["wall_s"], "start_s": m["start_s"]}

    sums = {name: summary(m) for name, m in measured.items()}
    want = [r["outputs"] for r in base["requests"]] if base else None
    for name, s in sums.items():
        b = sums.get(BASE)
        equal = None if want is None else [r["outputs"] for r in measured[name]["requests"]] == want
        note = "" if equal is None else ("outputs equal sglang's" if equal else "OUTPUTS DIFFER from sglang's")
        out.append(row(f"{name} ttft mean", s["ttft_ms"], "ms", b and b["ttft_ms"], BASE, note=note))
        out.append(row(f"{name} ttft mean turns 2+", s["warm_ttft_ms"], "ms", b and b["warm_ttft_ms"], BASE))
        out.append(row(f"{name} prefill computed", s["prefill"], "tokens", b and b["prefill"], BASE))
        out.append(row(f"{name} cached from host tier", s["host"], "tokens"))
        out.append(row(f"{name} cached from storage", s["storage"], "tokens"))
        out.append(row(f"{name} throughput", s["throughput"], "tok/s", b and b["throughput"], BASE))
        out.append(row(f"{name} server start", s["start_s"], "s"))
    if "hicache" in sums:
        h = sums["hicache"]
        for other in ("sglang-host", "sglang-file"):
            if other in sums:
                o = sums[other]
                out.append(row(f"hicache prefill computed vs {other}", h["prefill"], "tokens", o["prefill"], other))
                out.append(row(f"hicache ttft turns 2+ vs {other}", h["warm_ttft_ms"], "ms", o["warm_ttft_ms"],
                               other))
                out.append(row(f"hicache throughput vs {other}", h["throughput"], "tok/s", o["throughput"], other))
    return out


def run(args: argparse.Namespace) -> list[dict]:
    own = args.workdir is None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-sglang-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = build_tiny_llama(work / "tiny-llama")
        rounds = conversations(args.conversations, args.turns, args.system_tokens, args.user_tokens,
                               args.reply_tokens)
        measured = {name: _measure(name, model, rounds, args, work) for name in args.configs}
        return rows(measured)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
