"""The tenant quotas' admin RPC methods: decode, change the quota table, encode.

What a quota is and how it is enforced: hicache/daemon/core/quotas.py.

  quota_set   {tier, min?, max?, model? extra_key? | namespace?} -> the quota's row
  quota_clear {tier?, model? extra_key? | namespace?} -> {"cleared": n}
  quota_list  {} -> {"quotas": rows, ...}

`min` and `max` are a size (`2GiB`, or bytes as an int) or a share of the tier
(`25%`); no `max` is the whole tier. A namespace is named by its salt: 32 hex
digits, or a prefix of a namespace this daemon knows (as `hicache ls` prints
it). A bad request changes nothing: the whole table is checked first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.config import SALT_HEX_CHARS, QuotaSpec, parse_share
from hicache.errors import ConfigError
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext

QUOTA_METHODS = frozenset({"quota_set", "quota_clear", "quota_list"})  # admin only
MAX_NAME_CHARS = 1024


def quota_handlers(daemon: DaemonContext) -> dict[str, Any]:
    svc = daemon.service
    assert svc is not None and svc.quotas is not None
    quotas = svc.quotas

    def text(p: dict, name: str, default: Any = None) -> Any:
        value = p.get(name, default)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_NAME_CHARS):
            raise RpcError(Code.BAD_PARAMS, f"parameter {name!r} must be a string of at most "
                                            f"{MAX_NAME_CHARS} characters")
        return value

    def share(p: dict, name: str) -> Any:
        value = p.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise RpcError(Code.BAD_PARAMS, f"parameter {name!r} is a size or a share such as '25%'")
        try:
            return parse_share(value)
        except ConfigError as e:
            raise RpcError(Code.BAD_PARAMS, f"{name}: {e}") from None

    def salt_of(query: str) -> str:
        query = query.lower()
        if len(query) == SALT_HEX_CHARS:
            return query  # a full salt: it may name a namespace that has not registered yet
        found = [ns.salt.hex() for ns in svc.namespaces.values() if ns.salt.hex().startswith(query)] if query else []
        if len(found) != 1:
            raise RpcError(Code.BAD_PARAMS, f"namespace {query!r} matches {len(found)} namespaces this daemon knows; "
                                            f"pass the full salt ({SALT_HEX_CHARS} hex digits)")
        return found[0]

    def tenant(p: dict) -> dict[str, Any]:
        namespace = text(p, "namespace")
        return {"model": text(p, "model", ""), "extra_key": text(p, "extra_key"),
                "namespace": salt_of(namespace) if namespace else ""}

    def tier(p: dict, required: bool) -> str | None:
        value = text(p, "tier")
        if value is None and not required:
            return None
        if value not in ("host", "disk"):
            raise RpcError(Code.BAD_PARAMS, "tier must be 'host' or 'disk'")
        if quotas.capacities.get(value) is None:
            raise RpcError(Code.BAD_PARAMS, f"this daemon has no {value} tier")
        return value

    def quota_set(conn: Any, p: dict) -> Any:
        t = tier(p, required=True)
        low = share(p, "min")
        try:
            spec = QuotaSpec(tier=t, max=share(p, "max"), **tenant(p),
                             **({"min": low} if low is not None else {}))
            quotas.set(spec)
        except ConfigError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        return next(r for r in quotas.rows() if r["tier"] == t and r["tenant"] == spec.describe())

    def quota_clear(conn: Any, p: dict) -> Any:
        who = tenant(p)
        if bool(who["model"]) == bool(who["namespace"]) or (who["extra_key"] is not None and not who["model"]):
            raise RpcError(Code.BAD_PARAMS, "name the tenant by model (and optionally extra_key) or by namespace")
        return {"cleared": quotas.clear((who["model"], who["extra_key"], who["namespace"]), tier(p, required=False))}

    def quota_list(conn: Any, p: dict) -> Any:
        return {"quotas": quotas.rows(), **{k: v for k, v in quotas.stats().items() if k != "rows"}}

    return {"quota_set": quota_set, "quota_clear": quota_clear, "quota_list": quota_list}
