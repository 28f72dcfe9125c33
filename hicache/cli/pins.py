"""`hicache pin` / `unpin` / `prioritize`: an admin keeps a prefix in a tier for a time,
or orders its eviction by a priority (hicache/index/priorities.py).

The prefix is named by its tokens (`--tokens 1,2,3` or `--tokens-file`, full
pages only), by page keys in hex (`--key`, as `hicache ls` lists a pin), or for
SGLang by its pages' hashes (`--sglang-key`, in chain order; the last one is
enough for a chain the daemon holds). The namespace is a salt prefix or model
name as `hicache ls` shows it. See hicache/index/pins.py for what a pin does.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import numpy as np

from hicache.config import admin_socket_path
from hicache.errors import HiCacheError

TIMEOUT_S = 10.0
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def ttl_seconds(text: str) -> float:
    """`300`, `90s`, `5m`, `1h`, `1d`."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration (e.g. 300, 5m, 1h): {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, helptext in (("pin", "keep a prefix in a tier for a time (admin)"),
                           ("unpin", "drop the pin of a prefix (admin)"),
                           ("prioritize", "order a prefix's eviction by a priority, for a time (admin)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--socket", dest="socket_path", help="daemon socket (default: as `hicache serve`)")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.add_argument("--namespace", required=True, metavar="NS", help="salt hex prefix or model (as `hicache ls`)")
        what = p.add_mutually_exclusive_group(required=True)
        what.add_argument("--tokens", help="the prefix's token ids, comma separated")
        what.add_argument("--tokens-file", help="a file of token ids (whitespace or comma separated, or a JSON list)")
        what.add_argument("--key", nargs="+", metavar="HEX", help="page keys in hex, root first (or a pin's key)")
        what.add_argument("--sglang-key", nargs="+", metavar="HASH", help="SGLang page hashes, in chain order")
        if name == "pin":
            p.add_argument("--tier", choices=["host", "disk"], default="host")
            p.add_argument("--ttl", type=ttl_seconds, required=True, help="how long: 300, 5m, 1h, 1d")
            p.add_argument("--priority", type=int, default=0, help="-1000..1000: lower gives way first (default 0)")
        elif name == "prioritize":
            p.add_argument("--priority", type=int, required=True,
                           help="-1000..1000: lower pages leave first; 0 drops the prefix's priority")
            p.add_argument("--ttl", type=ttl_seconds, help="how long (default: the daemon's priority_ttl_s)")
        else:
            p.add_argument("--tier", choices=["host", "disk"], help="only this tier's pin (default: both)")


def _tokens(text: str) -> bytes:
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [int(t) for t in re.split(r"[\s,]+", text) if t]
        return np.asarray(values, dtype="<i4").tobytes()
    except (ValueError, TypeError, OverflowError) as e:
        raise HiCacheError(f"token ids must be integers: {e}") from None


def _prefix(args: argparse.Namespace, call: Any) -> dict:
    if args.tokens is not None:
        return {"tokens": _tokens(args.tokens)}
    if args.tokens_file is not None:
        with open(args.tokens_file, encoding="utf-8") as f:
            return {"tokens": _tokens(f.read())}
    if args.key is not None:
        try:
            return {"keys": b"".join(bytes.fromhex(k) for k in args.key)}
        except ValueError:
            raise HiCacheError("--key takes page keys in hex") from None
    from hicache.client.keyed import named_page

    ns = _namespace_entry(call("ls", {"depth": 0}), args.namespace)
    salt, page_size = bytes.fromhex(ns["namespace"]), ns["layout"]["page_size"]
    return {"keys": b"".join(named_page(salt, h.encode(), page_size)[0] for h in args.sglang_key)}


def _namespace_entry(tree: dict, query: str) -> dict:
    found = [ns for ns in tree["namespaces"] if ns["namespace"].startswith(query.lower())]
    found = found or [ns for ns in tree["namespaces"] if ns["model"] == query]
    if len(found) != 1:
        raise HiCacheError(f"namespace {query!r} matches {len(found)} namespaces (see hicache ls)")
    return found[0]


def run(args: argparse.Namespace) -> int:
    from hicache.client.connection import RpcConnection

    def call(method: str, params: dict) -> Any:
        return RpcConnection.one_call(admin_socket_path(args.socket_path), method, params, TIMEOUT_S)

    params = {"namespace": args.namespace, **_prefix(args, call)}
    if args.command == "prioritize":
        params["priority"] = args.priority
        if args.ttl is not None:
            params["ttl_s"] = args.ttl
        r = call("prioritize", params)
        text = (f"priority {r['priority']} on {r['pages']} pages (key {r['key']})" if r["pages"]
                else f"priority dropped (key {r['key']})")
        print(json.dumps(r) if args.json else text)
        return 0
    if args.tier is not None:
        params["tier"] = args.tier
    if args.command == "pin":
        r = call("pin", {**params, "ttl_s": args.ttl, "priority": args.priority})
        text = f"pinned {r['pages']} pages in {r['tier']} for {args.ttl:g}s (key {r['key']})"
    else:
        r = call("unpin", params)
        text = f"removed {r['removed']} pins"
    print(json.dumps(r) if args.json else text)
    return 0
