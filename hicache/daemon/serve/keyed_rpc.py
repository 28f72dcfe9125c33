"""The keyed pages' RPC methods (SGLang's storage API): decode, call KeyedPages, encode.

What the pages are and how they are kept: hicache/daemon/ingest/keyed.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.daemon.ingest.keyed import MAX_KEYED_BATCH, KeyedPages
from hicache.index.keys import KEY_BYTES, PackedKeys
from hicache.rpc.framing import ids_to_bytes
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext


def keyed_handlers(daemon: DaemonContext, keys_of: Any) -> dict[str, Any]:
    """RPC methods over KeyedPages; `keys_of` checks and splits a request's packed keys."""
    svc = daemon.service
    assert svc is not None
    assert daemon.puts is not None
    pages = KeyedPages(svc, daemon.puts.counters)

    def batch(p: dict) -> PackedKeys:
        keys = keys_of(p)
        if len(keys) > MAX_KEYED_BATCH:
            raise RpcError(Code.BAD_PARAMS, f"more than {MAX_KEYED_BATCH} keys in one keyed call")
        return keys

    def exists(conn: Any, p: dict) -> Any:
        return {"present": pages.exists(conn, p.get("engine"), batch(p))}

    async def fetch(conn: Any, p: dict) -> Any:
        pin, slots = await pages.fetch(conn, p.get("engine"), batch(p), daemon.disk)
        return {"pin": pin.pin_id, "host_pages": ids_to_bytes(slots),
                "slabs": daemon.host.slab_version(pin.engine.ns.salt)}

    def store(conn: Any, p: dict) -> Any:
        keys = batch(p)
        tokens = p.get("tokens")
        if not isinstance(tokens, bytes) or len(tokens) % 4:
            raise RpcError(Code.BAD_PARAMS, "tokens must be packed int32")
        parent = p.get("parent")
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
            raise RpcError(Code.BAD_PARAMS, f"parameter 'parent' must be a {KEY_BYTES}-byte page key")
        res = pages.store(conn, p.get("engine"), keys, np.frombuffer(tokens, dtype="<i4"), parent)
        if res is None:
            return {"store": None}
        # The slabs the copies go to, at their generation: an engine that maps those needs
        # no remap before copying, even when the version counts new (spare) slabs.
        host, slots = daemon.host, res.data.slots
        under = np.unique(res.engine.ns.page_class.slab_of(slots[slots >= 0])).tolist()
        return {"store": res.res_id, "host_pages": ids_to_bytes(slots),
                "slabs": host.slab_version(res.engine.ns.salt),
                "page_slabs": [[s, host.arena.slab_gen(s)] for s in under]}

    def store_done(conn: Any, p: dict) -> Any:
        ok = p.get("ok", True)
        if not isinstance(ok, bool):
            raise RpcError(Code.BAD_PARAMS, "parameter 'ok' must be a bool")
        return {"stored": pages.store_done(conn, p.get("store"), ok)}

    return {"exists": exists, "fetch": fetch, "store": store, "store_done": store_done}
