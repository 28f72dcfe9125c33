"""`hicache quota`: show and change tenant quotas on a running daemon.

  hicache quota ls
  hicache quota set --model llama-3-8b [--extra-key tenant-a] --tier host --min 25% --max 60%
  hicache quota set --namespace 0628ec3f --tier disk --min 20GiB
  hicache quota clear --model llama-3-8b [--tier host]

A change lasts until the daemon restarts (the config file's `quotas` are the
standing ones). The daemon checks the whole table first and changes nothing
when a rule breaks (min > max, minimums over the tier's capacity, a tier it
lacks). What the rules do: hicache/daemon/core/quotas.py.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache.config import QUOTA_TIERS, admin_socket_path, format_size

ADMIN_TIMEOUT_S = 10.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quota", help="tenant quotas: each tenant's minimum and maximum share of host and disk")
    actions = p.add_subparsers(dest="quota_action", required=True)

    def common(q: argparse.ArgumentParser, tenant: bool) -> None:
        q.add_argument("--socket", dest="socket_path", help="daemon socket (default: as `hicache serve`)")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if tenant:
            who = q.add_mutually_exclusive_group(required=True)
            who.add_argument("--model", help="every namespace of this model (all TP ranks and extra keys)")
            who.add_argument("--namespace", metavar="SALT", help="one namespace: its salt or a prefix as "
                                                                 "`hicache ls` prints it")
            q.add_argument("--extra-key", help="with --model: only its namespaces with this extra key (a tenant salt)")

    common(actions.add_parser("ls", help="usage against each quota's min and max"), tenant=False)
    q = actions.add_parser("set", help="add or replace a tenant's quota on one tier")
    common(q, tenant=True)
    q.add_argument("--tier", choices=list(QUOTA_TIERS), required=True)
    q.add_argument("--min", help="guaranteed share: a size (2GiB) or a share of the tier (25%%); default 0")
    q.add_argument("--max", help="maximum share, as --min; default the whole tier")
    q = actions.add_parser("clear", help="drop a tenant's quotas")
    common(q, tenant=True)
    q.add_argument("--tier", choices=list(QUOTA_TIERS), help="only this tier's (default both)")


def _call(args: argparse.Namespace, method: str, params: dict[str, Any]) -> Any:
    from hicache.client.connection import RpcConnection

    return RpcConnection.one_call(admin_socket_path(args.socket_path), method, params, ADMIN_TIMEOUT_S)


def _tenant(args: argparse.Namespace) -> dict[str, Any]:
    if args.extra_key is not None and not args.model:
        raise argparse.ArgumentTypeError("--extra-key goes with --model")
    out: dict[str, Any] = {"model": args.model} if args.model else {"namespace": args.namespace}
    if args.extra_key is not None:
        out["extra_key"] = args.extra_key
    return out


def quota_lines(rows: list[dict]) -> list[str]:
    """The quota table, as `hicache stats` and `hicache quota ls` print it."""
    if not rows:
        return []
    lines = [f"{'quota':<6}{'tenant':<36}{'used':>10}{'min':>18}{'max':>18}  namespaces"]
    for r in rows:
        def bound(share: str | None, nbytes: int) -> str:  # a share of the tier shows what it is now
            if share is None:
                return "-"
            return f"{format_size(nbytes)} ({share})" if share.endswith("%") else format_size(nbytes)
        flag = "" if r["within_quota"] else "  over max"
        lines.append(f"{r['tier']:<6}{r['tenant'][:35]:<36}{format_size(r['used_bytes']):>10}"
                     f"{bound(r['min'], r['min_bytes']):>18}{bound(r['max'], r['max_bytes']):>18}"
                     f"  {len(r['namespaces'])}{flag}")
    return lines


def run(args: argparse.Namespace) -> int:
    from hicache.errors import HiCacheError

    if args.quota_action == "ls":
        r = _call(args, "quota_list", {})
        if args.json:
            print(json.dumps(r))
        else:
            print("\n".join(quota_lines(r["quotas"])) or "no quotas")
        return 0
    try:
        who = _tenant(args)
    except argparse.ArgumentTypeError as e:
        raise HiCacheError(str(e)) from None
    if args.quota_action == "set":
        params = {**who, "tier": args.tier}
        params.update({k: v for k, v in (("min", args.min), ("max", args.max)) if v is not None})
        r = _call(args, "quota_set", params)
        print(json.dumps(r) if args.json else "\n".join(quota_lines([r])))
        return 0
    params = {**who, **({"tier": args.tier} if args.tier else {})}
    r = _call(args, "quota_clear", params)
    print(json.dumps(r) if args.json else f"cleared {r['cleared']} quotas")
    return 0
