"""The pin and priority RPC methods: decode, call Retention (hicache/daemon/core/retention.py), encode.

`pin` / `unpin` / `prioritize` name a prefix by its page keys (`keys`, packed, root first;
SGLang's named pages by their keys, see hicache/client/keyed.py) or by its
tokens (`tokens`, packed int32: the daemon hashes the full pages), and its
namespace by an engine the connection registered (`engine`) or by `namespace`
(a salt in hex, a unique salt prefix or model name, as `hicache ls` shows it):
an admin may name any namespace, anyone else only those its connection
registered.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.core.records import NamespaceState
from hicache.index.keys import KEY_BYTES, PackedKeys, page_keys
from hicache.index.pins import PIN_TIERS, TIER_OF, PinBoundError, PinError, PinNotStored
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext

MAX_PRIORITY = 1000  # priorities are -1000..1000; 0 by default


def pin_handlers(daemon: DaemonContext, keys_of: Any) -> dict[str, Any]:
    svc, retention = daemon.service, daemon.retention
    assert svc is not None and retention is not None
    max_pages = daemon.config.max_request_pages

    def namespace_of(conn: Any, p: dict) -> NamespaceState:
        if p.get("engine") is not None:
            return svc.engine(conn, p["engine"]).ns
        query = p.get("namespace")
        if not isinstance(query, str) or not query or len(query) > 1024:
            raise RpcError(Code.BAD_PARAMS, "name the namespace: 'engine' (registered here) or 'namespace'")
        found = [ns for ns in svc.namespaces.values() if ns.salt.hex().startswith(query.lower())]
        if not found:
            found = [ns for ns in svc.namespaces.values() if ns.namespace.model == query]
        if len(found) != 1:
            raise RpcError(Code.NOT_FOUND, f"namespace {query!r} matches {len(found)} namespaces this daemon "
                                           "knows; pass more of its salt")
        ns = found[0]
        if not conn.admin and ns.salt.hex() not in conn.namespaces:
            raise RpcError(Code.FORBIDDEN, "only an admin pins in a namespace this connection did not register")
        return ns

    def prefix_of(ns: NamespaceState, p: dict) -> list[bytes]:
        if ("keys" in p) == ("tokens" in p):
            raise RpcError(Code.BAD_PARAMS, "name the prefix by 'keys' or by 'tokens' (one of them)")
        if "keys" in p:
            keys = keys_of(p)
        else:
            tokens = p["tokens"]
            ps = ns.namespace.layout.page_size
            if not isinstance(tokens, bytes) or len(tokens) % 4 or len(tokens) > 4 * ps * max_pages:
                raise RpcError(Code.BAD_PARAMS, f"tokens must be packed int32, at most {max_pages} pages")
            keys = page_keys(ns.salt, np.frombuffer(tokens, dtype="<i4"), ps)
        if not keys:
            raise RpcError(Code.BAD_PARAMS, "the prefix holds no full page")
        return keys

    def tier_of(p: dict, default: str | None) -> Any:
        name = p.get("tier")
        if name is None:  # absent or nil: the default (pin: host; unpin: every tier)
            name = default
        if name is None:
            return None
        if not isinstance(name, str) or name not in PIN_TIERS:
            raise RpcError(Code.BAD_PARAMS, f"tier must be one of {tuple(PIN_TIERS)}")
        return PIN_TIERS[name]

    def pin(conn: Any, p: dict) -> Any:
        ns = namespace_of(conn, p)
        tier = tier_of(p, "host")
        ttl = p.get("ttl_s")
        if type(ttl) not in (int, float) or not math.isfinite(ttl):
            raise RpcError(Code.BAD_PARAMS, "ttl_s must be a number of seconds")
        priority = p.get("priority", 0)
        if type(priority) is not int or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise RpcError(Code.BAD_PARAMS, f"priority must be an int in -{MAX_PRIORITY}..{MAX_PRIORITY}")
        keys = prefix_of(ns, p)
        try:
            pinned = retention.pin(ns, tier, keys, float(ttl), priority)
        except PinNotStored as e:
            raise RpcError(Code.NOT_FOUND, str(e)) from None
        except PinBoundError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        except PinError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        return {"namespace": ns.salt.hex(), "tier": TIER_OF[tier], "pages": len(pinned.pinned),
                "expires_at": pinned.expires_at, "key": pinned.keys[-1].hex()}

    def prioritize(conn: Any, p: dict) -> Any:
        ns = namespace_of(conn, p)
        priority = p.get("priority")
        if type(priority) is not int or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise RpcError(Code.BAD_PARAMS, f"priority must be an int in -{MAX_PRIORITY}..{MAX_PRIORITY}")
        if p.get("tier") is not None:
            raise RpcError(Code.BAD_PARAMS, "a priority holds in every tier the prefix is in: no 'tier'")
        ttl = p.get("ttl_s")  # absent or nil: the daemon's priority_ttl_s
        if ttl is not None and (type(ttl) not in (int, float) or not math.isfinite(ttl)):
            raise RpcError(Code.BAD_PARAMS, "ttl_s must be a number of seconds")
        keys = prefix_of(ns, p)
        try:
            entry = retention.prioritize(ns, keys, priority, None if ttl is None else float(ttl))
        except PinNotStored as e:
            raise RpcError(Code.NOT_FOUND, str(e)) from None
        except PinError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        if entry is None:  # priority 0: back to the policy's order
            return {"namespace": ns.salt.hex(), "pages": 0, "priority": 0, "expires_at": None,
                    "key": keys[-1].hex()}
        return {"namespace": ns.salt.hex(), "pages": len(entry.pages), "priority": entry.priority,
                "expires_at": entry.expires_at, "key": entry.keys[-1].hex()}

    def unpin(conn: Any, p: dict) -> Any:
        ns = namespace_of(conn, p)
        tier = tier_of(p, None)
        if "key" in p:  # the pin's name as `hicache ls` lists it: its last page key
            key = p["key"]
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise RpcError(Code.BAD_PARAMS, f"key must be one {KEY_BYTES}-byte page key")
            keys: list[bytes] = PackedKeys(key)
        else:
            keys = prefix_of(ns, p)
        return {"removed": retention.unpin(ns, keys, tier)}

    return {"pin": pin, "unpin": unpin, "prioritize": prioritize}
