"""RPC methods: decode parameters, call the CacheService, encode the answer.

Every handler validates its parameters before touching state, so a bad
request is answered with BAD_PARAMS and changes nothing; every size and
length is checked against a limit derived from the config (Config.max_*).

Roles: the server refuses everything before `hello` and the ADMIN_METHODS to a
peer that is not an admin. A non-admin peer sees only the namespaces its
connection registered: in `ls`, in the events it subscribed to, and in the
engines `stats` lists (tiers and counters stay aggregate).
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache import __version__
from hicache.daemon.core.validation import split_keys
from hicache.daemon.hybrid.states import state_layout_param
from hicache.daemon.serve.keyed_rpc import keyed_handlers
from hicache.daemon.serve.pin_rpc import pin_handlers
from hicache.daemon.serve.portable import portable_handlers
from hicache.daemon.serve.quota_rpc import QUOTA_METHODS, quota_handlers
from hicache.daemon.movers.state_dir import allocated_bytes
from hicache.daemon.serve.tree_view import DEFAULT_LIMIT, MAX_DEPTH, MAX_NODES, tree_page
from hicache.errors import LayoutError
from hicache.index.keys import KEY_BYTES, Namespace, PackedKeys
from hicache.index.radix import Tier
from hicache.layout import KVLayout
from hicache.rpc.framing import bytes_to_ids, ids_to_bytes
from hicache.rpc.protocol import MAX_PREFILL_RATE, PROTOCOL_VERSION, Code, RpcError
from hicache.rpc.connection import Connection, WithFds

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext

EMPTY = np.empty(0, dtype=np.int64)
TIERS = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}

# Destructive or cross-namespace: the server checks these before the handler runs.
ADMIN_METHODS = frozenset({"flush", "evict_tier", "doctor", "export_open", "export_next",
                           "import_open", "import_pages", "remote_flush", "settle", *QUOTA_METHODS})
MAX_SETTLE_S = 60.0
MAX_NAME_CHARS = 1024  # model names, extra keys, namespace queries
MAX_TP_SIZE = 1 << 16
MAX_STORE_PAGES = 1 << 20  # register's store size; the spare room it asks for is capped by the arena
MAX_EVICT_BYTES = (1 << 63) - 1
EVICT_STEP_PAGES = 4096  # evict_tier lets the loop run between steps of this many pages
LOAD_UNTIL = ("policy", "complete", "now")  # how long `load` waits for a match's lookups and reads


def _get(params: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in params or (params[name] is None and default is None):
        if default is ...:
            raise RpcError(Code.BAD_PARAMS, f"missing parameter {name!r}")
        return default
    value = params[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise RpcError(Code.BAD_PARAMS, f"parameter {name!r} has the wrong type")
    return value


def _int(params: dict, name: str, lo: int, hi: int, default: Any = ...) -> int:
    value = _get(params, name, int, default)
    if not lo <= value <= hi:
        raise RpcError(Code.BAD_PARAMS, f"parameter {name!r} must be in {lo}..{hi}")
    return value


def _str(params: dict, name: str, default: Any = ...) -> str:
    value = _get(params, name, str, default)
    if len(value) > MAX_NAME_CHARS:
        raise RpcError(Code.BAD_PARAMS, f"parameter {name!r} is longer than {MAX_NAME_CHARS} characters")
    return value


def _ids(params: dict, name: str, limit: int) -> np.ndarray:
    raw = _get(params, name, bytes)
    if len(raw) > 4 * limit:
        raise RpcError(Code.BAD_PARAMS, f"{name}: more than {limit} ids")
    try:
        return bytes_to_ids(raw, name)
    except RpcError:
        raise
    except Exception as e:
        raise RpcError(Code.BAD_PARAMS, str(e)) from None


def _tier(params: dict, allowed: tuple[str, ...]) -> Tier:
    name = _get(params, "tier", str)
    if name not in allowed:
        raise RpcError(Code.BAD_PARAMS, f"tier must be one of {allowed}")
    return TIERS[name]


def _prefill_rate(params: dict, default: Any = ...) -> float:
    """An engine's prefill rate in tokens/s: a finite number in 0..MAX_PREFILL_RATE (0: unknown)."""
    value = _get(params, "prefill_tokens_per_s", (int, float), default)
    if isinstance(value, bool) or not 0 <= value <= MAX_PREFILL_RATE:  # NaN fails the comparison too
        raise RpcError(Code.BAD_PARAMS,
                       f"parameter 'prefill_tokens_per_s' must be a number in 0..{MAX_PREFILL_RATE:g}")
    return float(value)


def _backup_plan(backup: Any) -> dict | None:
    if backup is None:
        return None
    return {"id": backup.backup_id, "host_pages": ids_to_bytes(backup.host_pages),
            "device_pages": ids_to_bytes(backup.device_pages)}


def build_handlers(daemon: DaemonContext) -> dict[str, Any]:
    svc, host = daemon.service, daemon.host
    cfg = daemon.config
    max_pages = cfg.max_request_pages

    def keys_of(p: dict) -> Any:
        blob = _get(p, "keys", bytes)
        if len(blob) > KEY_BYTES * max_pages:
            raise RpcError(Code.BAD_PARAMS, f"more than {max_pages} keys in one request (max_request_pages)")
        return split_keys(blob)

    def hello(conn: Connection, p: dict) -> Any:
        version = _get(p, "version", int)
        if version != PROTOCOL_VERSION:
            raise RpcError(Code.VERSION, f"protocol version {version} not supported (daemon speaks {PROTOCOL_VERSION})")
        conn.state["hello"] = True
        # The arena's geometry only: its slabs' fds go to engines by namespace (map_slabs).
        return {"version": PROTOCOL_VERSION, "server": f"hicache {__version__}", "pid": os.getpid(),
                "arena_bytes": daemon.host.arena.nbytes, "slab_bytes": daemon.host.slab_bytes,
                "num_slabs": daemon.host.num_slabs, "instance": daemon.instance}

    def register(conn: Connection, p: dict) -> Any:
        try:
            layout = KVLayout.from_dict(_get(p, "layout", dict))
        except (LayoutError, TypeError) as e:
            raise RpcError(Code.BAD_PARAMS, f"bad layout: {e}") from None
        ns = Namespace(model=_str(p, "model"), layout=layout, tp_rank=_get(p, "tp_rank", int, 0),
                       tp_size=_int(p, "tp_size", 1, MAX_TP_SIZE, 1), extra_key=_str(p, "extra_key", ""),
                       state=state_layout_param(p.get("state")))  # hybrid models: their recurrent state
        if not 0 <= ns.tp_rank < ns.tp_size:
            raise RpcError(Code.BAD_PARAMS, "need 0 <= tp_rank < tp_size")
        if ns.state is not None and daemon.hybrid is not None:
            daemon.hybrid.check_namespace(ns)
        rate = _prefill_rate(p, 0.0)
        store_pages = _int(p, "store_pages", 0, MAX_STORE_PAGES, 0)
        rec = svc.register(conn, ns, _get(p, "device_pages", int))
        rec.prefill_tokens_per_s = rate
        # Spare slabs for stores of that size now: the reply's slab version names them, so the
        # engine maps and pre-faults them before its first store (hicache/daemon/core/host_tier.py).
        rec.ns.page_class.expect_stores(store_pages)
        conn.namespaces.add(rec.ns.salt.hex())  # what this connection may see from now on
        reply = {"engine": rec.engine_id, "salt": rec.ns.salt, "page_bytes": layout.page_bytes,
                 "write_policy": svc.write_policy.value, "slabs": host.slab_version(rec.ns.salt)}
        if ns.state is not None:
            reply["state_bytes"] = ns.state.checkpoint_bytes
        return reply

    def report(conn: Connection, p: dict) -> Any:
        """What an engine measured of itself: its prefill rate (fetch_or_recompute.py)."""
        rate = _prefill_rate(p)
        svc.engine(conn, _get(p, "engine", int)).prefill_tokens_per_s = rate
        return True

    slab_versions = host.slab_versions  # read per reply: an engine remaps when its slabs grew
    hybrid, remote = daemon.hybrid, daemon.remote

    max_key_bytes = KEY_BYTES * max_pages

    def match(conn: Connection, p: dict) -> Any:
        # The checks of keys_of and _get, spelled out for the well-formed request: every
        # engine request waits on this handler (a malformed one takes the general path).
        blob, eid = p.get("keys"), p.get("engine")
        if type(blob) is bytes and len(blob) <= max_key_bytes and not len(blob) % KEY_BYTES:
            keys = PackedKeys(blob)
        else:
            keys = keys_of(p)
        rec = svc.engine(conn, eid if type(eid) is int else _get(p, "engine", int))
        if hybrid is not None and rec.ns.namespace.state is not None:
            # a hybrid namespace's match is cut at its usable prefix
            pin, state = hybrid.match(conn, rec.engine_id, keys)
        else:
            pin, state = svc.match_engine(rec, keys), None
        if (remote is not None and state is None and pin.recompute_from is None
                and pin.device_len + pin.host_len + pin.disk_len < len(keys)
                and remote.lookups.start(pin, keys)):
            # the local prefix stops short: the store is asked in the background, never waited
            # for here; the engine asks again (`load`) while the reply says pending
            reply = match_reply(pin, None)
            reply["pending"] = True
            return reply
        return match_reply(pin, state)

    def fast_match(conn: Connection, engine_id: int, blob: bytes) -> tuple | None:
        """`match` for the native frame loop's common request (hicache/rpc/native_conn.py):
        the answer as a tuple its C encodes, byte for byte match_reply's dict. Declines
        (None, before changing anything) what `match` would refuse or answer otherwise."""
        if len(blob) > max_key_bytes or len(blob) % KEY_BYTES:
            return None
        rec = svc.engines.get(engine_id)
        if rec is None or rec.owner is not conn or (hybrid is not None and rec.ns.namespace.state is not None):
            return None
        pin = svc.match_engine(rec, PackedKeys(blob))
        return (pin.pin_id, pin.device_pages, pin.host_pages, pin.disk_len,
                slab_versions.get(rec.ns.salt, 0))

    if remote is None:  # a match with a remote tier may answer `pending`: the general path
        match.fast = fast_match  # type: ignore[attr-defined]

    def match_reply(pin: Any, state: Any) -> dict:
        reply = {"pin": pin.pin_id, "device_pages": ids_to_bytes(pin.device_pages),
                 "host_pages": ids_to_bytes(pin.host_pages),
                 "disk_len": pin.disk_len, "slabs": slab_versions.get(pin.engine.ns.salt, 0)}
        if state is not None:
            reply["state"] = state
        return reply

    async def load(conn: Connection, p: dict) -> Any:
        """The host plan for a match, with what its disk prefetch and remote fetch brought up.
        `until`: "policy" waits for a running remote probe (a lookup: its answer says what
        there is to load), then per the load policy; "complete" until every lookup and read
        of the pin has ended; "now" not at all. `pending` while the pin's probe still runs."""
        until = _get(p, "until", str, "policy")
        if until not in LOAD_UNTIL:
            raise RpcError(Code.BAD_PARAMS, f"parameter 'until' must be one of {', '.join(LOAD_UNTIL)}")
        pin = svc.pin(conn, _get(p, "pin", int))
        policy = {"policy": cfg.load_policy, "complete": "wait_complete", "now": "best_effort"}[until]
        remote, disk = daemon.remote, daemon.disk
        if remote is not None and until != "now" and remote.lookups.pending(pin):
            await remote.lookups.wait_probe(pin)  # the store's op timeout bounds it
            _still_pinned(pin)
        if disk is not None and pin.prefetch is not None:
            await disk.wait_prefetch(pin, policy, cfg.prefetch_timeout_s)
            _still_pinned(pin)
            svc.take_prefetched(pin)
        if remote is not None and pin.remote is not None:  # after the disk part, behind it
            await remote.lookups.wait_fetch(pin, policy, cfg.prefetch_timeout_s)
            _still_pinned(pin)
            remote.lookups.take_fetched(pin)
        reply = {"host_pages": ids_to_bytes(pin.host_pages), "disk_len": pin.disk_len,
                 "slabs": host.slab_version(pin.engine.ns.salt)}
        if remote is not None and remote.lookups.pending(pin):
            reply["pending"] = True
        if daemon.hybrid is not None:
            state = await daemon.hybrid.load(pin, policy)
            if state is not None:
                reply["state"] = state
        return reply

    def _still_pinned(pin: Any) -> None:
        if pin.pin_id not in svc.pins:
            raise RpcError(Code.NOT_FOUND, "the match was released while loading")

    def load_done(conn: Connection, p: dict) -> Any:
        dups = svc.load_done(conn, _get(p, "pin", int), _ids(p, "device_pages", max_pages),
                             reclaim=_get(p, "reclaim", bool, False))
        return {"free_pages": ids_to_bytes(dups)}

    def release(conn: Connection, p: dict) -> Any:
        pin_id = p.get("pin")
        svc.release(conn, pin_id if type(pin_id) is int else _get(p, "pin", int))
        return True

    def fast_release(conn: Connection, pin_id: int, _: None) -> bool | None:
        """`release` for the native frame loop (as fast_match); declines an unknown pin."""
        pin = svc.pins.get(pin_id)
        if pin is None or pin.engine.owner is not conn:
            return None
        svc.drop_pin(pin)
        return True

    release.fast = fast_release  # type: ignore[attr-defined]

    def insert(conn: Connection, p: dict) -> Any:
        keys = keys_of(p)
        tokens = _get(p, "tokens", bytes)
        if len(tokens) % 4:
            raise RpcError(Code.BAD_PARAMS, "tokens must be packed int32")
        device_pages = _ids(p, "device_pages", len(keys))
        if daemon.hybrid is not None:  # hybrid namespaces: plus the state checkpoints offered
            states = _get(p, "states", list, None)
            if states is not None and len(states) > len(tokens) // 4:
                raise RpcError(Code.BAD_PARAMS, "more state offers than tokens")
            present, dups, backup, state_backup = daemon.hybrid.insert(
                conn, _get(p, "engine", int), keys, np.frombuffer(tokens, dtype="<i4"), device_pages,
                _get(p, "pin", int, None), states)
        else:
            present, dups, backup = svc.insert(conn, _get(p, "engine", int), keys,
                                               np.frombuffer(tokens, dtype="<i4"), device_pages,
                                               _get(p, "pin", int, None))
            state_backup = None
        reply = {"present_pages": present, "free_pages": ids_to_bytes(dups), "backup": _backup_plan(backup),
                 "slabs": _slab_version(conn, p)}
        if state_backup is not None:
            reply["state_backup"] = {"id": state_backup.backup_id,
                                     "host_slots": [e[2] for e in state_backup.entries],
                                     "device_slots": [e[3] for e in state_backup.entries],
                                     "positions": [e[1] for e in state_backup.entries]}
        return reply

    def put(conn: Connection, p: dict) -> Any:
        """Reserve host pages for the keys' pages not on host yet (see puts.py)."""
        keys = keys_of(p)
        tokens = _get(p, "tokens", bytes)
        if len(tokens) % 4:
            raise RpcError(Code.BAD_PARAMS, "tokens must be packed int32")
        put, present = daemon.puts.put(conn, _get(p, "engine", int), keys, np.frombuffer(tokens, dtype="<i4"))
        return {"put": None if put is None else put.res_id, "present": present,
                "host_pages": ids_to_bytes(put.host_pages if put is not None else EMPTY),
                "slabs": _slab_version(conn, p)}

    def put_done(conn: Connection, p: dict) -> Any:
        added = daemon.puts.done(conn, _get(p, "engine", int), _get(p, "put", int), _get(p, "ok", bool, True))
        return {"added": added}

    def state_backup_done(conn: Connection, p: dict) -> Any:
        if daemon.hybrid is None:
            raise RpcError(Code.NOT_FOUND, "no state backups on this daemon")
        return {"stored": daemon.hybrid.backup_done(conn, _get(p, "backup", int), _get(p, "ok", bool, True))}

    def backup_done(conn: Connection, p: dict) -> Any:
        freed = svc.backup_done(conn, _get(p, "backup", int), _get(p, "ok", bool, True))
        return {"free_pages": ids_to_bytes(freed)}

    def evict(conn: Connection, p: dict) -> Any:
        free_now, backup = svc.evict_device(conn, _get(p, "engine", int),
                                            _int(p, "num_pages", 0, cfg.max_device_pages))
        return {"free_pages": ids_to_bytes(free_now), "backup": _backup_plan(backup),
                "slabs": _slab_version(conn, p)}

    def _slab_version(conn: Connection, p: dict) -> int:
        return host.slab_version(svc.engine(conn, _get(p, "engine", int)).ns.salt)

    def map_slabs(conn: Connection, p: dict) -> Any:
        """The fds of the host slabs holding this engine's namespace, for those the engine
        does not map at their current generation (`have`: [[slab, gen], ...])."""
        owner = svc.engine(conn, _get(p, "engine", int)).ns.salt
        have = _get(p, "have", list, [])
        if len(have) > host.num_slabs:
            raise RpcError(Code.BAD_PARAMS, f"have lists more than the arena's {host.num_slabs} slabs")
        known: dict[int, int] = {}
        for item in have:
            if (not isinstance(item, list) or len(item) != 2 or
                    not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise RpcError(Code.BAD_PARAMS, "have must hold [slab, generation] int pairs")
            known[item[0]] = item[1]
        owned = host.slabs_of(owner)
        send = [(s, g) for s, g in owned if known.get(s) != g]
        reply = {"version": host.slab_version(owner), "owned": [[s, g] for s, g in owned],
                 "sent": [[s, g] for s, g in send]}
        if not send:
            return reply
        return WithFds(reply, [host.arena.slab_fd(s) for s, _ in send])

    def unregister(conn: Connection, p: dict) -> Any:
        rec = svc.engine(conn, _get(p, "engine", int))
        svc.disconnect_engine(rec)
        return True

    def stats(conn: Connection, p: dict) -> Any:
        st = daemon.stats()
        if not conn.admin:  # other tenants' engines (model, pid) are theirs; counts stay aggregate
            mine = {r.engine_id for r in svc.engines.values() if r.owner is conn}
            st["engines"] = [e for e in st["engines"] if e["engine"] in mine]
            if st.get("quotas"):  # the quotas naming its own namespaces only
                st["quotas"]["rows"] = [r for r in st["quotas"]["rows"] if r["min"] is not None
                                        and conn.namespaces.intersection(r["namespaces"])]
        return st

    async def flush(conn: Connection, p: dict) -> Any:
        pages = 0
        for pages in svc.flush_steps(_tier(p, ("host", "disk"))):
            await asyncio.sleep(0)  # one namespace per loop turn
        return {"pages": pages}

    async def evict_tier(conn: Connection, p: dict) -> Any:
        tier, num_bytes = _tier(p, ("host", "disk")), _int(p, "bytes", 0, MAX_EVICT_BYTES)
        done = 0
        for done in svc.evict_tier_steps(tier, num_bytes, EVICT_STEP_PAGES):
            await asyncio.sleep(0)
        return {"bytes": done}

    async def ls(conn: Connection, p: dict) -> Any:
        """One page of the prefix trees (tree_view.py); `after`: the `next` of the page before."""
        depth = _int(p, "depth", 0, MAX_DEPTH, 2)
        limit = _int(p, "limit", 1, MAX_NODES, DEFAULT_LIMIT)
        after = _get(p, "after", dict, None)
        if after is not None:
            ns_hex, index = after.get("namespace"), after.get("index")
            if type(ns_hex) is not str or len(ns_hex) != 2 * KEY_BYTES or type(index) is not int or index < 0:
                raise RpcError(Code.BAD_PARAMS, "after must be the `next` of an earlier ls reply")
            after = (ns_hex, index)
        spaces = [ns for ns in svc.namespaces.values() if conn.admin or ns.salt.hex() in conn.namespaces]
        out = await tree_page(spaces, depth, limit, after)
        by_hex = {ns.salt.hex(): ns for ns in spaces}
        for entry in out["namespaces"]:
            ns = by_hex[entry["namespace"]]
            entry["pins"] = daemon.retention.listing(ns.salt)
            entry["priorities"] = daemon.retention.priority_listing(ns.salt)
        return out

    async def settle(conn: Connection, p: dict) -> Any:
        """Wait until the disk's pages are indexed (a big tier's restore), every disk write and
        delete queued so far is committed and no write is in flight, nor a remote write (at
        most `timeout_s`): a replay calls it between requests so that what reaches the disk
        and the remote store, and the disk budget's totals, do not depend on the writer
        threads' timing. {"settled": False} when the deadline passed first."""
        timeout = p.get("timeout_s", 10.0)
        if type(timeout) not in (int, float) or not 0 <= timeout <= MAX_SETTLE_S:
            raise RpcError(Code.BAD_PARAMS, f"timeout_s must be a number in [0, {MAX_SETTLE_S:g}]")
        deadline = time.monotonic() + timeout
        disk, remote = daemon.disk, daemon.remote
        if disk is not None:
            restored = disk.restore is None or await disk.restore.wait(deadline - time.monotonic())
            if not restored or not await asyncio.to_thread(disk.tier.flush, timeout):  # deletes and touches too
                return {"settled": False}
            while disk.writes:
                if time.monotonic() >= deadline:
                    return {"settled": False}
                await asyncio.sleep(0.0005)  # commits arrive on this loop from the writer thread
        while remote is not None and remote.queued_pages:  # records built or sent on the remote worker
            if time.monotonic() >= deadline:
                return {"settled": False}
            await asyncio.sleep(0.0005)
        return {"settled": True}

    async def remote_flush(conn: Connection, p: dict) -> Any:
        """Delete one namespace's records from the remote store (every daemon sharing it
        loses them): by a full salt in hex, or a namespace this daemon knows by salt prefix
        or model name."""
        if daemon.remote is None:
            raise RpcError(Code.BAD_PARAMS, "this daemon has no remote tier (--remote-url)")
        query = _str(p, "namespace")
        try:
            salt = bytes.fromhex(query) if len(query) == 2 * KEY_BYTES else None
        except ValueError:
            salt = None
        if salt is None:
            salt = _resolve_namespace(query)
        try:
            deleted = await daemon.remote.flush_namespace(salt)
        except Exception as e:
            # not INTERNAL (a daemon bug): the store is away; try again when `stats` shows it up
            raise RpcError(Code.BUSY, f"the remote store failed: {type(e).__name__} {e}"[:300]) from None
        return {"namespace": salt.hex(), "deleted": deleted}

    def _resolve_namespace(query: str) -> bytes:
        found = [ns for ns in svc.namespaces.values() if ns.salt.hex().startswith(query.lower())] if query else []
        if not found:
            found = [ns for ns in svc.namespaces.values() if ns.namespace.model == query]
        if len(found) != 1:
            raise RpcError(Code.BAD_PARAMS, f"namespace {query!r} matches {len(found)} namespaces this daemon "
                                            "knows; pass the full salt (32 hex digits)")
        return found[0].salt

    def sync(conn: Connection, p: dict) -> Any:
        """Nothing: its answer tells the client every earlier request of the connection
        was handled (posted ones get no answer when they succeed; see rpc/protocol.py)."""
        return True

    def subscribe(conn: Connection, p: dict) -> Any:
        conn.subscribed = True
        return True

    async def doctor(conn: Connection, p: dict) -> Any:
        """What only the daemon can see, for `hicache doctor` (reads only)."""
        cfg, host = daemon.config, daemon.host
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        disk = None
        if daemon.disk is not None:
            tier = daemon.disk.tier
            disk = {**tier.stats(), **daemon.disk.stats(), **await asyncio.to_thread(tier.reader_health),
                    "max_queue_pages": tier.config.max_queue_pages, "path": str(tier.path)}
        fs = await asyncio.to_thread(shutil.disk_usage, cfg.state_dir)
        allocated, files = await asyncio.to_thread(allocated_bytes, cfg.state_dir)
        unlimited = resource.RLIM_INFINITY
        return {"pid": os.getpid(), "version": __version__, "uid": os.getuid(), "gid": os.getgid(),
                "time": time.time(), "uptime_s": time.time() - daemon.started_at, "state_dir": str(cfg.state_dir),
                "memlock_limit": [None if x == unlimited else x for x in (soft, hard)],
                "host": {"capacity_bytes": host.capacity_bytes, "slab_bytes": host.slab_bytes,
                         "locked": host.arena.locked, "mlock": cfg.mlock},
                "disk": disk, "state_fs": {"total_bytes": fs.total, "free_bytes": fs.free},
                "state_usage": {"allocated_bytes": allocated, "files": files,
                                "disk_capacity": cfg.disk_capacity if cfg.disk_enabled else 0}}

    return {"hello": hello, "register": register, "unregister": unregister, "report": report, "match": match,
            "load": load, "load_done": load_done, "map_slabs": map_slabs, "release": release, "insert": insert,
            "backup_done": backup_done, "put": put, "put_done": put_done,
            "state_backup_done": state_backup_done,
            "evict": evict, "stats": stats, "flush": flush, "settle": settle, "evict_tier": evict_tier, "ls": ls,
            "subscribe": subscribe, "sync": sync, "doctor": doctor, "remote_flush": remote_flush,
            **portable_handlers(daemon), **keyed_handlers(daemon, keys_of), **quota_handlers(daemon),
            **pin_handlers(daemon, keys_of)}
