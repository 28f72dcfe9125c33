"""`hicache` command line: serve, admin commands, benchmarks, demo.

Every error reaches the user as one line on stderr and a non-zero exit status:
bad arguments (2), a daemon that cannot be reached, is not trusted or refuses
this peer (2), anything else hicache or the OS reports (1), a closed stdout
such as `| head` (141, quietly, as if killed by SIGPIPE). `--debug` or
HICACHE_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, NoReturn

from hicache import __version__
from hicache.config import (DISK_ADMISSION, DISK_PLACEMENTS, EVICTION_POLICIES, admin_socket_path, format_size,
                            load_config)
from hicache.cpu_list import parse_cpu_list
from hicache.errors import DaemonRefused, DaemonUnavailable, DaemonUntrusted, HiCacheError

ADMIN_TIMEOUT_S = 10.0
MAX_WATCH_S = 86400.0
DEFAULT_WATCH_S = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen: a watch redraws in place
MAX_LS_DEPTH = 64  # the daemon walks the tree recursively; deeper views are unreadable anyway
EXIT_USAGE = 2
EXIT_UNREACHABLE = 2
EXIT_SIGPIPE = 128 + 13


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def watch_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_WATCH_S:
        raise argparse.ArgumentTypeError(f"must be > 0 and at most {MAX_WATCH_S:.0f} seconds, got {text!r}")
    return value


def watch_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def cpu_list(text: str) -> str:
    """A CPU list (`1`, `0-3,8`), checked here; the config parses it again (files, variables)."""
    try:
        parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def ls_depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= MAX_LS_DEPTH:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_LS_DEPTH}, got {text!r}")
    return value


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", dest="socket_path", help="daemon socket (default: as `hicache serve`)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (the one being run) other commands' heavy
    argument tables may be left out (`hicache serve` does not import every benchmark)."""
    parser = Parser(prog="hicache", description="Tiered KV-cache daemon for LLM inference engines.")
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also HICACHE_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    _add_socket(s)
    s.add_argument("--state-dir")
    s.add_argument("--host-capacity", help="host arena size, e.g. 512MiB, 4GiB")
    s.add_argument("--disk-capacity", help="disk tier size, e.g. 20GiB: its LMDB file, allocated at start "
                                          "(default: 4 GiB or a tenth of the free space, whichever is smaller)")
    s.add_argument("--no-disk", dest="disk_enabled", action="store_const", const=False, default=None,
                   help="run without the disk tier")
    s.add_argument("--reset-disk", action="store_const", const=True, default=None,
                   help="delete the disk tier's environment and start fresh")
    s.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"])
    s.add_argument("--load-policy", choices=["best_effort", "wait_complete", "timeout"])
    s.add_argument("--eviction-policy", choices=list(EVICTION_POLICIES),
                   help="which pages each tier evicts first (default frecency; lru for comparison)")
    s.add_argument("--disk-admission", choices=list(DISK_ADMISSION),
                   help="which host pages the disk takes once it is full (default reuse: those expected back)")
    s.add_argument("--disk-placement", choices=list(DISK_PLACEMENTS),
                   help="host-disk placement (default inclusive: written through, so they survive a restart)")
    s.add_argument("--metrics-port", type=int)
    s.add_argument("--remote-url", help="remote tier on Redis/Valkey (standalone or any node of a Cluster): "
                                        "redis://[user:password@]host:port, rediss://..., unix:///path; "
                                        "or on Mooncake Store: mooncake://master_host:port[?metadata=URL&...]")
    s.add_argument("--remote-password-file", help="the remote store's password, from a file (wins over the URL's)")
    s.add_argument("--remote-secret-file", help="cluster secret(s) that sign remote records, one per line: the "
                                                "first signs, all verify (without it records are unauthenticated)")
    s.add_argument("--quota", dest="quotas", action="append", metavar="SPEC",
                   help="a tenant quota, repeatable: model=NAME[,extra_key=KEY] or namespace=SALT, then "
                        "tier=host|disk,min=SHARE,max=SHARE (a size or a share of the tier, e.g. 25%%)")
    s.add_argument("--cpus", type=cpu_list, metavar="LIST",
                   help="the CPUs the daemon and its threads run on, e.g. 1 or 2-3 (default: those it was started "
                        "with); off the cores an engine's forward pass is bound to")
    s.add_argument("--config", dest="config_file", help="TOML file ([hicache] table or top-level keys)")

    for name, helptext in (("stats", "tier and engine statistics"), ("ls", "the prefix tree per namespace")):
        p = sub.add_parser(name, help=helptext)
        _add_socket(p)
        _add_json(p)
        if name == "stats":
            p.add_argument("--watch", type=watch_seconds, nargs="?", const=DEFAULT_WATCH_S, metavar="SECONDS",
                           help=f"redraw every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C")
            p.add_argument("--count", type=watch_count, metavar="N", help="with --watch: stop after N refreshes")
        else:
            p.add_argument("--depth", type=ls_depth, default=2, help=f"tree levels to show (0..{MAX_LS_DEPTH})")

    p = sub.add_parser("evict", help="evict bytes from a tier")
    _add_socket(p)
    _add_json(p)
    p.add_argument("--tier", choices=["host", "disk"], required=True)
    p.add_argument("--bytes", required=True, help="how much, e.g. 1GiB")

    p = sub.add_parser("flush", help="drop a tier entirely (pinned pages stay), or a namespace's remote records")
    _add_socket(p)
    _add_json(p)
    p.add_argument("--tier", choices=["host", "disk", "remote"], required=True)
    p.add_argument("--namespace", help="remote: the namespace (salt prefix or model name as `hicache ls` shows, "
                                       "or a full salt of one this daemon does not know)")

    from hicache.cli.admin import add_parsers as add_admin
    from hicache.cli.pins import add_parsers as add_pins
    from hicache.cli.quota import add_parser as add_quota

    if command in (None, "bench"):
        from hicache.bench.cli import add_parser as add_bench

        add_bench(sub)
    else:  # importing every benchmark's module took ~0.2 s of each daemon start
        sub.add_parser("bench", help="benchmarks, each next to a baseline measured in the same run")
    add_admin(sub)  # doctor, export, import
    add_quota(sub)
    add_pins(sub)  # pin, unpin, prioritize

    p = sub.add_parser("demo", help="start a daemon with embedded defaults and run a demo workload through it")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--host-capacity", default="256MiB")
    p.add_argument("--disk-capacity", default="1GiB")
    return parser


def _admin_call(args: argparse.Namespace, method: str, params: dict[str, Any] | None = None) -> Any:
    from hicache.client.connection import RpcConnection

    return RpcConnection.one_call(admin_socket_path(args.socket_path), method, params, ADMIN_TIMEOUT_S)


def _print_stats(st: dict) -> None:
    print(f"hicache {st['version']}  pid {st['pid']}  up {st['uptime_s']:.0f}s  "
          f"policy {st['write_policy']}  eviction {st.get('eviction_policy', '-')}  "
          f"connections {st['connections']}")
    print(f"{'tier':<8}{'capacity':>12}{'used':>12}{'pages':>10}{'hit rate':>10}{'evicted':>10}")
    for name in ("device", "host", "disk", "remote"):
        t = st["tiers"].get(name)
        if t is None:
            continue
        cap = format_size(t["capacity_bytes"]) if "capacity_bytes" in t else "-"
        used = format_size(t["used_bytes"]) if "used_bytes" in t else "-"
        print(f"{name:<8}{cap:>12}{used:>12}{t.get('pages', 0):>10}{t.get('hit_rate', 0.0):>10.1%}"
              f"{t.get('evicted_pages', 0):>10}")
    rt = st["tiers"].get("remote")
    if rt is not None:
        print(f"remote  {rt.get('kind', 'redis')} {rt['url']} ({rt['mode']}, {rt['state']})  "
              f"written {rt['written_pages']}  "
              f"hits {rt['hit_pages']}  misses {rt['miss_pages']}  corrupt {rt['corrupt_records']}  "
              f"auth {rt.get('auth', '-')}  "
              f"errors {rt['errors']}  dropped {rt['dropped_pages']}  "
              f"read {format_size(rt['bytes_read'])}  written {format_size(rt['bytes_written'])}"
              + (f"  full: {rt['admission']['rejected_pages']} pages not admitted"
                 if rt.get("admission", {}).get("rejected_pages") else "")
              + (f"  last error: {rt['last_error']}" if rt["last_error"] else ""))
    fr = st.get("fetch_or_recompute")
    if fr and fr["enabled"] and (fr["engines_with_rate"] or any(fr["skipped_pages"].values())):
        print(_fetch_line(fr))
    r = st["requests"]
    print(f"matches {r['matches']}  inserts {r['inserts']}  loaded pages {r['loaded_pages']}  "
          f"backups {r['backups']} ({r['backup_pages']} pages)  pins {st['pins']}")
    pn = st.get("pinned")
    if pn and (pn["host"]["pins"] or pn["disk"]["pins"] or pn["expired"]):
        print("pinned " + "  ".join(f"{t} {pn[t]['pins']} ({pn[t]['pages']} pages, {pn[t]['suspended']} suspended)"
                                     for t in ("host", "disk"))
              + f"  expired {pn['expired']}  refused {pn['refused']}")
    pr = st.get("priorities")
    if pr and (pr["prefixes"] or pr["expired"] or pr["refused"]):
        print(f"prioritized {pr['prefixes']} prefixes ({pr['pages']} pages, {pr['positive_pages']} above 0)"
              f"  expired {pr['expired']}  refused {pr['refused']}")
    g = st.get("gc")
    if g and g["managed"]:
        print(f"gc managed: {g['passes']} passes (longest {g['max_pass_ms']:.1f} ms), "
              f"{g['frozen_objects']} objects frozen, idle full passes {g['full_passes']} "
              f"(longest {g['max_full_pass_ms']:.1f} ms, found {g['full_pass_found']})")
    p = st.get("puts")
    if p and p["puts"]:  # engines with their own device cache (vLLM) store through puts
        print(f"puts {p['puts']} ({p['committed_pages']} pages stored)  pending {p['pending']}  "
              f"failed {p['failed']}  expired {p['expired']}  no space {p['skipped_no_space']}")
    q = st.get("quotas")
    if q and q["rows"]:
        from hicache.cli.quota import quota_lines

        print("\n".join(quota_lines(q["rows"])))
    if st.get("native"):
        print(native_line(st["native"]))
    if st["engines"]:
        print(f"{'engine':<8}{'model':<24}{'tp':>4}{'pid':>8}{'resident':>10}{'pool':>8}")
        for e in st["engines"]:
            print(f"{e['engine']:<8}{e['model'][:23]:<24}{e['tp_rank']:>4}{e['pid'] or '-':>8}"
                  f"{e['resident_pages']:>10}{e['device_pages']:>8}")


def native_line(paths: dict[str, dict]) -> str:
    """Which hot paths run in C, and which in Python and why (`stats`' `native` section)."""
    native = [p.replace("_", " ") for p, e in paths.items() if e["runs"] == "native"]
    python = [f"{p.replace('_', ' ')} ({e['reason']})" for p, e in paths.items() if e["runs"] == "python"]
    return f"native: {', '.join(native) or 'nothing'}" + (f"; in Python: {'; '.join(python)}" if python else "")


def _fetch_line(fr: dict) -> str:
    """Fetch or recompute: the tiers' measured read speed and what was left to be recomputed."""
    parts = []
    for tier, s in fr["tiers"].items():
        if s["samples"] and s["bytes_per_s"]:
            parts.append(f"{tier} {format_size(int(s['bytes_per_s']))}/s + {s['latency_s'] * 1e3:.2f} ms")
    skipped = "  ".join(f"{t} {fr['skipped_pages'][t]} pages ({fr['skipped_tokens'][t]} tokens)"
                        for t in fr["skipped_pages"])
    return (f"fetch or recompute: {fr['engines_with_rate']} engine(s) report a prefill rate; reads "
            f"{', '.join(parts) or 'not measured yet'}; recomputed instead: {skipped}")


def _interval_line(before: dict, after: dict, seconds: float) -> str:
    """What happened between two views: lookups per second and each tier's hit rate over them
    (the table's hit rates are since the daemon started)."""
    asked = after["requests"]["requested_pages"] - before["requests"]["requested_pages"]
    matches = after["requests"]["matches"] - before["requests"]["matches"]
    line = f"last {seconds:.1f}s: {matches / max(seconds, 1e-9):.1f} matches/s, {asked} pages asked"
    if asked > 0:
        rates = []
        for name in ("device", "host", "disk", "remote"):
            a, b = after["tiers"].get(name), before["tiers"].get(name)
            if a is None or b is None:
                continue
            hit = (a["hit_rate"] * after["requests"]["requested_pages"]
                   - b["hit_rate"] * before["requests"]["requested_pages"])
            rates.append(f"{name} {max(0.0, hit) / asked:.1%}")
        line += "; hit rate " + " ".join(rates)
    return line


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in ("socket_path", "state_dir", "host_capacity", "disk_capacity",
                                               "disk_enabled", "reset_disk", "write_policy", "load_policy",
                                               "eviction_policy", "disk_admission", "disk_placement",
                                               "metrics_port", "remote_url", "remote_password_file",
                                               "remote_secret_file", "quotas", "cpus")}
    config = load_config(args.config_file, overrides)
    if config.disk_enabled and not config.reset_disk:
        from hicache.tiers.disk import env as disk_env

        disk_env.start_verify(str(config.disk_dir))  # the disk's check reads while the daemon's modules load
    from hicache.daemon.serve.app import serve

    return serve(config)


def cmd_stats(args: argparse.Namespace) -> int:
    """One view, or with --watch a view redrawn every SECONDS (appended when stdout is not a
    terminal, one JSON document a line with --json) until Ctrl-C or --count views."""
    import time

    if args.count is not None and not args.watch:
        print("hicache stats: error: --count needs --watch (see hicache stats --help)", file=sys.stderr)
        return EXIT_USAGE
    redraw = bool(args.watch) and not args.json and sys.stdout.isatty()
    shown = 0
    prev: dict | None = None
    prev_t = 0.0
    try:
        while True:
            st = _admin_call(args, "stats")
            if args.json:
                print(json.dumps(st))
            else:
                if redraw:
                    sys.stdout.write(CLEAR_SCREEN)
                _print_stats(st)
                if args.watch:
                    if prev is not None:
                        print(_interval_line(prev, st, time.monotonic() - prev_t))
                    print(f"every {args.watch:g}s, {time.strftime('%H:%M:%S')}"
                          + ("  (Ctrl-C stops)" if redraw else ""))
            prev, prev_t = st, time.monotonic()
            shown += 1
            if not args.watch or (args.count is not None and shown >= args.count):
                return 0
            sys.stdout.flush()
            time.sleep(args.watch)
            if not args.json and not redraw:
                print()
    except KeyboardInterrupt:
        if args.watch:  # Ctrl-C is how a watch ends
            return 0
        raise


def cmd_ls(args: argparse.Namespace) -> int:
    import time

    pages = [_admin_call(args, "ls", {"depth": args.depth})]  # the daemon pages it: follow `next`
    while pages[-1].get("next") is not None:
        pages.append(_admin_call(args, "ls", {"depth": args.depth, "after": pages[-1]["next"]}))
    spaces: list[dict] = []
    for page in pages:  # a namespace split across pages: its entries joined under one header
        for ns in page["namespaces"]:
            if spaces and spaces[-1]["namespace"] == ns["namespace"] and ns["first"]:
                spaces[-1]["tree"] += ns["tree"]
                spaces[-1]["truncated"] |= ns["truncated"]
            else:
                spaces.append(ns)
    tree = {"namespaces": spaces}
    if args.json:
        print(json.dumps(tree))
        return 0
    for ns in tree["namespaces"]:
        pages = ns["pages"]
        print(f"{ns['namespace'][:16]}  {ns['model']}  tp{ns['tp_rank']}  page {format_size(ns['page_bytes'])}  "
              f"device {pages['device']}  host {pages['host']}  disk {pages['disk']} pages")

        def show(nodes: list[dict], indent: int) -> None:
            for n in nodes:
                tiers = "".join(t for t, on in (("D", n["engines"]), ("H", n["host"]), ("S", n["disk"])) if on)
                print(f"{'  ' * indent}- {n['pages']} pages [{tiers or '-'}] hits {n['hits']} "
                      f"{n['child_count']} children")
                show(n["children"], indent + 1)

        show(ns["tree"], 1)
        for pin in ns.get("pins", ()):
            until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pin["expires_at"]))
            print(f"  pin {pin['key'][:16]}  {pin['tier']}  {pin['pages']} pages  until {until}  "
                  f"priority {pin['priority']}" + ("" if pin["active"] else "  (suspended: over quota)"))
        for pr in ns.get("priorities", ()):
            until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pr["expires_at"]))
            print(f"  priority {pr['priority']}  {pr['key'][:16]}  {pr['pages']} pages  until {until}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    from hicache.config import parse_size

    r = _admin_call(args, "evict_tier", {"tier": args.tier, "bytes": parse_size(args.bytes)})
    print(json.dumps(r) if args.json else f"evicted {format_size(r['bytes'])} from {args.tier}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    if args.tier == "remote":
        if not args.namespace:
            raise HiCacheError("flush --tier remote needs --namespace (it deletes records other daemons share)")
        r = _admin_call(args, "remote_flush", {"namespace": args.namespace})
        print(json.dumps(r) if args.json else f"deleted {r['deleted']} remote records of namespace {r['namespace']}")
        return 0
    if args.namespace:
        raise HiCacheError("--namespace goes with --tier remote only")
    r = _admin_call(args, "flush", {"tier": args.tier})
    print(json.dumps(r) if args.json else f"flushed {r['pages']} pages from {args.tier}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hicache.bench.engines.demo import run_demo

    return run_demo(args)


def cmd_admin(args: argparse.Namespace) -> int:
    from hicache.cli.admin import run

    return run(args)


def cmd_quota(args: argparse.Namespace) -> int:
    from hicache.cli.quota import run

    return run(args)


def cmd_pins(args: argparse.Namespace) -> int:
    from hicache.cli.pins import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from hicache.bench.cli import run

    return run(args)


COMMANDS = {"bench": cmd_bench, "serve": cmd_serve, "stats": cmd_stats, "ls": cmd_ls, "evict": cmd_evict, "flush": cmd_flush,
            "demo": cmd_demo, "doctor": cmd_admin, "export": cmd_admin, "import": cmd_admin, "quota": cmd_quota,
            "pin": cmd_pins, "unpin": cmd_pins, "prioritize": cmd_pins}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get("HICACHE_DEBUG", "").strip() not in ("", "0")
    try:
        rc = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        rc, line = describe_error(e)
        print(f"hicache: {line}", file=sys.stderr)
        return rc


def describe_error(e: Exception) -> tuple[int, str]:
    """The exit status and the one line a user sees for `e`."""
    if isinstance(e, (DaemonUntrusted, DaemonRefused)):
        return EXIT_UNREACHABLE, e.message
    if isinstance(e, DaemonUnavailable):
        return EXIT_UNREACHABLE, f"the daemon is not running or not reachable ({e.message})"
    if isinstance(e, HiCacheError):
        return 1, _one_line(str(e))
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return 1, _one_line(f"{where}{e.strerror or e}")
    return 1, _one_line(f"internal error: {type(e).__name__}: {e} (--debug or HICACHE_DEBUG=1 shows the traceback)")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
