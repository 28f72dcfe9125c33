"""`hicache bench NAME`: argument parsing and dispatch for every benchmark."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from hicache.bench.daemon.scale_bench import add_arguments as scale_arguments
from hicache.bench.daemon.soak_bench import add_arguments as soak_arguments
from hicache.bench.engines.sglang_serve_bench import add_arguments as sglang_serve_arguments
from hicache.bench.engines.vllm_bench import add_arguments as vllm_arguments
from hicache.bench.plot import plot, plot_file, require_matplotlib
from hicache.bench.policy.pin_bench import add_arguments as pin_arguments
from hicache.bench.report import print_rows
from hicache.bench.rpc.native_echo import VARIANTS as NATIVE_ECHO_VARIANTS
from hicache.bench.traces.trace_files import DEFAULT_TRACE
from hicache.config import DISK_ADMISSION, DISK_PLACEMENTS, EVICTION_POLICIES



def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks, each next to a baseline measured in the same run")
    benches = p.add_subparsers(dest="bench", required=True)

    def bench(name: str, helptext: str) -> argparse.ArgumentParser:
        b = benches.add_parser(name, help=helptext)
        b.add_argument("--json", action="store_true", help="one JSON object with a `results` list")
        return b

    b = bench("rpc", "match / insert round trips vs a bare echo server and redis-server")
    b.add_argument("--socket", dest="socket_path", help="a running daemon (default: start one)")
    b.add_argument("--prompt-tokens", type=int, default=8192)
    b.add_argument("--requests", type=int, default=2000)
    b.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    b.add_argument("--repeats", type=int, default=5, help="rounds per server; percentiles are medians over them")
    b.add_argument("--pin", action="store_true", help="servers on CPU 0, clients on the other CPUs")
    b.add_argument("--calls", nargs="+", choices=["match", "insert", "puts", "handlers"],
                   default=["match", "insert"],
                   help="which calls to time (puts: a step's 8 put reservations, pipelined vs one by one; "
                        "handlers: the daemon's CPU for a match + release in-process, vs echo's frame work)")
    b.add_argument("--servers", nargs="+", default=[], choices=[f"native-{v}" for v in NATIVE_ECHO_VARIANTS],
                   help="native echo servers timed beside the others (C epoll loop; C reader callback on uvloop "
                        "answering in C, or calling a Python handler per frame: identity / msgpack echo)")

    b = bench("native", "each native (C) path against its Python fallback: what `hicache doctor` quotes")
    b.add_argument("--paths", nargs="+", choices=["index", "frame_loop", "disk_writer", "copy"],
                   default=["index", "frame_loop", "disk_writer", "copy"])
    b.add_argument("--index-pages", type=int, default=1 << 20, help="pages in the index the match walks")
    b.add_argument("--requests", type=int, default=2000, help="operations per round (index, frame loop)")
    b.add_argument("--disk-pages", type=int, default=512, help="64 KiB pages put per round")
    b.add_argument("--repeats", type=int, default=5, help="rounds of each side, taking turns")

    b = bench("transfer", "per-layer load and all-layer backup vs a contiguous copy")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: the memcpy path by thread count; cuda: every copy method on the GPU, "
                        "also vs a per-page cudaMemcpyAsync loop")
    b.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    b.add_argument("--repeats", type=int, default=9,
                   help="cpu: each row and its baseline timed back to back this many times; medians reported")
    b.add_argument("--threads", type=int, nargs="+", default=None,
                   help="cpu: copy thread counts (default: 1 and torch's intra-op count)")
    b.add_argument("--target-mib", type=int, default=1024)
    b.add_argument("--run-pages", type=int, default=64, help="cuda: pages per run in the 'runs' pattern")

    b = bench("blockcopy", "the vLLM connector's block saves and per-layer loads vs memcpy, per copy method")
    b.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    b.add_argument("--layers", type=int, default=8, help="the KV shape; default: `hicache bench vllm`'s model")
    b.add_argument("--kv-heads", type=int, default=4)
    b.add_argument("--head-size", type=int, default=64)
    b.add_argument("--block-size", type=int, default=32)
    b.add_argument("--target-mib", type=int, default=256, help="bytes moved per save and per load")
    b.add_argument("--repeats", type=int, default=9)
    b.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: what a 1-core vLLM CPU worker gives the torch path)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: KV tensors on the GPU in vLLM's CUDA layout, triton and torch methods "
                        "against one contiguous copy")

    b = bench("disk", "disk tier put / get vs raw py-lmdb and dd")
    b.add_argument("--total-mib", type=int, default=512)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--workdir")
    b.add_argument("--rebuild-records", type=int, default=1_000_000)

    b = bench("index", "radix match + insert pages/s replaying a trace")
    b.add_argument("--trace", default=DEFAULT_TRACE,
                   help="JSON lines, plain or .xz/.gz (default: the Mooncake conversation trace shipped with hicache)")
    b.add_argument("--limit", type=int)
    b.add_argument("--capacity", type=int, default=None, help="device budget in pages (default: unbounded)")

    b = bench("trace", "replay a Mooncake trace against a real daemon: hit rate per tier")
    b.add_argument("--trace", default=DEFAULT_TRACE,
                   help="JSON lines, plain or .xz/.gz (default: the Mooncake conversation trace shipped with hicache)")
    b.add_argument("--socket", dest="socket_path", help="a running daemon (default: start one)")
    b.add_argument("--host-capacity", default="2GiB")
    b.add_argument("--disk-capacity", default="4GiB",
                   help="the started daemon's disk tier (its LMDB file, allocated whole)")
    b.add_argument("--device-pages", type=int, default=2048)
    b.add_argument("--limit", type=int)
    b.add_argument("--page-bytes", type=int, default=64 << 10, help="bytes per 512-token block page")
    b.add_argument("--sim-fractions", type=float, nargs="*", default=[0.1, 0.15, 0.4],
                   help="also simulate the policies at these fractions of the trace's unique blocks")
    b.add_argument("--workload", choices=["chat", "agent", "rag", "scan", "mixed"],
                   help="a generated trace instead of --trace (--limit requests, default 4000)")
    b.add_argument("--seed", type=int, default=0, help="--workload: the generator's seed")
    b.add_argument("--sim-only", action="store_true",
                   help="only the simulated policies (OPT, LRU, ...): no daemon, no replay")
    b.add_argument("--eviction-policy", choices=list(EVICTION_POLICIES), default="frecency",
                   help="the started daemon's eviction policy (lru for comparison)")
    b.add_argument("--disk-admission", choices=list(DISK_ADMISSION), default="reuse",
                   help="the started daemon's disk admission (all: every page, as before admission)")
    b.add_argument("--disk-placement", choices=list(DISK_PLACEMENTS), default="inclusive",
                   help="the started daemon's host-disk placement")
    b.add_argument("--ablation-fractions", type=float, nargs="*", default=[0.15, 0.4],
                   help="simulate placement and admission variants at these fractions of the unique blocks")
    b.add_argument("--signals", action="store_true",
                   help="also simulate structure signals (depth, fan-out) as eviction priorities at --ablation-fractions")
    b.add_argument("--remote", action="store_true",
                   help="replay again with a local redis-server as the remote tier, once per --remote-admission "
                        "mode: remote writes per remote hit")
    b.add_argument("--remote-capacity", default="64MiB", help="--remote: the store's maxmemory")
    b.add_argument("--remote-admission", nargs="+", choices=["all", "reuse"], default=["all", "reuse"],
                   help="--remote: the modes to replay, the first the baseline")
    _add_plot(b, "hit rate against capacity: hicache, OPT, LRU and the other policies")

    b = bench("quota", "a victim tenant's hit rate alone, under another tenant's flood, and under it with a quota")
    b.add_argument("--tier", choices=["host", "disk"], default="host",
                   help="host: no disk tier, the quota on host; disk: a small host, the quota on disk")
    b.add_argument("--host-capacity", help="default 8MiB, with --tier disk 2MiB")
    b.add_argument("--disk-capacity", default="8MiB", help="--tier disk: the disk tier's size")
    b.add_argument("--rounds", type=int, default=5, help="passes over the victim's prompts")
    b.add_argument("--victim-prompts", type=int, default=8, help="the victim's prompts (4 pages of 64 KiB each)")
    b.add_argument("--flood-per-request", type=int, default=3,
                   help="one-shot prompts (8 pages each) the flooder sends between two of the victim's requests")
    b.add_argument("--victim-min", default="40%", help="the victim's guaranteed share of the tier")
    b.add_argument("--flood-max", help="with the quota, also cap the flooder's share of the tier (e.g. 25%%)")

    b = bench("remote", "remote tier put / get GB/s and lookup latency vs plain redis-py on the same store")
    b.add_argument("--backend", choices=["redis", "mooncake"], default="redis",
                   help="mooncake: the tier on a local Mooncake Store vs raw batch_put_from/batch_get_into "
                        "and vs the tier on Redis (--url: that Redis)")
    b.add_argument("--url", help="an existing Redis / Valkey (default: start a 3-master cluster on loopback)")
    b.add_argument("--page-kib", type=int, nargs="+", default=[64, 1024])
    b.add_argument("--total-mib", type=int, default=128, help="bytes moved per repeat and page size")
    b.add_argument("--repeats", type=int, default=5)

    soak_arguments(bench("soak", "32 engines cycling for minutes: daemon memory before/after, host slots accounted"))

    b = bench("vllm", "a real vLLM serving multi-turn conversations, or N requests at once step by step "
                      "(--concurrency): vLLM alone vs hicache vs LMCache (--compare)")
    vllm_arguments(b)
    _add_plot(b, "TTFT and prefill tokens computed, cold and warm, per configuration")

    b = bench("sglang", "SGLang's L3 batch_set_v1 / batch_get_v1 through hicache vs a plain copy")
    b.add_argument("--socket", dest="socket_path", help="a running daemon (default: start one)")
    b.add_argument("--layouts", nargs="+", default=["page_first", "layer_first"],
                   choices=["layer_first", "page_first", "page_first_direct", "page_head"])
    b.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    b.add_argument("--target-mib", type=int, default=256)
    b.add_argument("--repeats", type=int, default=9, help="the first ~4 fill the host tier, the rest evict")

    sglang_serve_arguments(bench("sglang-serve", "a real SGLang server on multi-turn chat: SGLang alone, its host "
                                                 "tier, its file backend and hicache, each its own process"))

    b = bench("pauses", "match p99.9 / max with a large index under write load, managed gc vs CPython's")
    b.add_argument("--nodes", type=int, default=100_000, help="index nodes before the timed part")
    b.add_argument("--seconds", type=float, default=60.0,
                   help="the timed part, per configuration (long enough for CPython to start a full collection)")
    b.add_argument("--workdir")

    b = bench("multiturn", "the reference engine serving multi-turn conversations")
    b.add_argument("--conversations", type=int, default=12)
    b.add_argument("--turns", type=int, default=4)
    _add_plot(b, "prefill tokens computed and TTFT per setup")

    scale_arguments(bench("scale", "a daemon filled to a million pages on the vLLM connector's path: fill rate, "
                                   "match, loop stalls, memory, kill -9 and restart, next to redis-server"))

    b = bench("pins", "pinned prefixes' hit rate under a flood of one-shot prompts, with pins vs without")
    pin_arguments(b)

    b = benches.add_parser("plot", help="draw the chart of a saved `hicache bench trace|vllm|multiturn --json` output")
    b.add_argument("results", help="the file the bench's --json output went to")
    b.add_argument("out", metavar="FILE", help="the chart to write (.png or .svg)")
    b.add_argument("--title")


def _add_plot(b: argparse.ArgumentParser, what: str) -> None:
    b.add_argument("--plot", metavar="FILE", help=f"also write a chart (.png or .svg; needs hicache[plot]): {what}")


def run(args: argparse.Namespace) -> int:
    if args.bench == "plot":
        bench = plot_file(args.results, args.out, args.title)
        print(f"wrote the {bench} chart to {args.out}")
        return 0
    chart = getattr(args, "plot", None)
    if chart:
        require_matplotlib(chart)  # before the run, not after minutes of it
    t0 = time.time()
    if args.bench == "rpc":
        from hicache.bench.rpc.rpc_bench import run as go
        calls = tuple(c for c in args.calls if c != "handlers")
        rows = go(args.socket_path, args.prompt_tokens, args.requests, tuple(args.clients), args.repeats, args.pin,
                  calls, tuple(args.servers)) if calls else []
        if "handlers" in args.calls:
            from hicache.bench.rpc.handler_bench import run as in_process
            rows += in_process(args.prompt_tokens, args.requests, args.repeats)
    elif args.bench == "native":
        from hicache.bench.rpc.native_bench import run as go
        rows = go(tuple(args.paths), index_pages=args.index_pages, requests=args.requests,
                  disk_pages=args.disk_pages, repeats=args.repeats)
    elif args.bench == "transfer" and args.device == "cuda":
        from hicache.bench.tiers.device_transfer_bench import run as go
        rows = go(tuple(args.page_sizes), device="cuda", repeats=args.repeats,
                  target_bytes=args.target_mib << 20, run_pages=args.run_pages)
    elif args.bench == "transfer":
        from hicache.bench.tiers.transfer_bench import run as go
        rows = go(tuple(args.page_sizes), repeats=args.repeats, target_bytes=args.target_mib << 20,
                  threads=tuple(args.threads) if args.threads else None)
    elif args.bench == "blockcopy" and args.device == "cuda":
        from hicache.bench.tiers.blockcopy_cuda_bench import run as go
        rows = go(args)
    elif args.bench == "blockcopy":
        from hicache.bench.tiers.blockcopy_bench import run as go
        rows = go(args)
    elif args.bench == "disk":
        from hicache.bench.tiers.disk_bench import run as go
        rows = go(total_bytes=args.total_mib << 20, workdir=args.workdir, repeats=args.repeats,
                  rebuild_records=args.rebuild_records)
    elif args.bench == "index":
        from hicache.bench.traces.index_bench import run as go
        rows = go(args.trace, limit=args.limit, capacity_pages=args.capacity)
    elif args.bench == "trace":
        from hicache.bench.traces.trace_bench import run as go
        rows = go(args)
    elif args.bench == "quota":
        from hicache.bench.policy.quota_bench import run as go
        rows = go(args)
    elif args.bench == "remote":
        if args.backend == "mooncake":
            from hicache.bench.tiers.mooncake_bench import run as go
        else:
            from hicache.bench.tiers.remote_bench import run as go
        rows = go(args.url, tuple(args.page_kib), args.total_mib, args.repeats)
    elif args.bench == "soak":
        from hicache.bench.daemon.soak_bench import run as go
        rows = go(args)
    elif args.bench == "vllm":
        from hicache.bench.engines.vllm_bench import run as go
        rows = go(args)
    elif args.bench == "sglang":
        from hicache.bench.engines.sglang_bench import run as go
        rows = go(args.socket_path, tuple(args.layouts), tuple(args.page_sizes), target_bytes=args.target_mib << 20,
                  repeats=args.repeats)
    elif args.bench == "sglang-serve":
        from hicache.bench.engines.sglang_serve_bench import run as go
        rows = go(args)
    elif args.bench == "pauses":
        from hicache.bench.daemon.pause_bench import run as go
        rows = go(args.nodes, args.seconds, args.workdir)
    elif args.bench == "pins":
        from hicache.bench.policy.pin_bench import run as go
        rows = go(args)
    elif args.bench == "scale":
        from hicache.bench.daemon.scale_bench import run as go
        rows = go(args)
    elif args.bench == "multiturn":
        from hicache.bench.engines.multiturn_bench import run as go
        rows = go(args)
    else:  # pragma: no cover - argparse restricts the choices
        raise SystemExit(f"unknown bench {args.bench}")
    meta = {"machine": f"{platform.machine()} {platform.node()}", "seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d"), "load_average": [round(x, 2) for x in os.getloadavg()]}
    print_rows(args.bench, rows, args.json, meta)
    if chart:
        plot(args.bench, rows, chart)
        print(f"hicache bench: wrote the chart to {chart}", file=sys.stderr)
    return 0
