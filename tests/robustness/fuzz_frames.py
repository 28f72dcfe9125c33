"""A seeded generator of hostile frames for every RPC method of the daemon.

Frames are built from a *valid* request for the method (using the engine ids,
pins, backups, export / import sessions the daemon handed out earlier on the
connection, so sequences like hello, register, match, insert, backup_done,
release look like an engine's), then damaged: parameters dropped, added or
replaced by values of the wrong type or absurd size, bytes cut or padded, ids
and method names mangled, the msgpack body garbled, nested thousands deep,
or the length prefix made to lie. The same seed gives the same frames.

Every `Frame` says how many replies a well-behaved daemon owes it (a complete
frame: exactly one; a frame that breaks the stream: none, and it is the last
one sent on its connection).
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from hicache.index.keys import Namespace, page_keys
from hicache.layout import KVLayout
from hicache.portable.format import ExportHeader, encode_end, encode_page
from hicache.rpc.protocol import PROTOCOL_VERSION
from hicache.state_layout import StateLayout

HEADER = struct.Struct(">I")

LAYOUTS = [
    KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8),
    KVLayout("mla", num_layers=1, page_size=2, dtype="bfloat16", kv_lora_rank=8, qk_rope_head_dim=4),
]
STATE = StateLayout(num_layers=1, conv_shapes=((4, 3),), temporal_shape=(2, 4), chunk_size=8)

# Every method of hicache/daemon/serve/handlers.py and portable.py (the test checks the list is complete).
METHODS = ("hello", "register", "unregister", "report", "match", "load", "load_done", "map_slabs", "release", "insert",
           "backup_done", "state_backup_done", "evict", "stats", "flush", "evict_tier", "ls", "subscribe",
           "doctor", "export_open", "export_next", "import_open", "import_pages", "remote_flush", "settle",
           "put", "put_done",  # host puts (hicache/daemon/ingest/puts.py)
           "exists", "fetch", "store", "store_done",  # keyed pages (hicache/daemon/ingest/keyed.py)
           "quota_set", "quota_clear", "quota_list",  # tenant quotas (hicache/daemon/serve/quota_rpc.py)
           "pin", "unpin", "prioritize",  # pinned and prioritized prefixes (hicache/daemon/serve/pin_rpc.py)
           "sync")  # the posted calls' barrier
# Costly admin calls that wipe what the sequences build: drawn less often.
RARE = {"flush": 0.15, "evict_tier": 0.3, "doctor": 0.3, "subscribe": 0.3, "unregister": 0.3, "remote_flush": 0.3, "settle": 0.3,
        "quota_set": 0.3, "quota_clear": 0.3}

INTS = [0, 1, -1, 2, 3, 7, 16, 255, 4096, 65535, 2**31 - 1, 2**31, -2**31, 2**32 - 1, 2**32, 2**53 + 1,
        2**63 - 1, -2**63, 2**64 - 1]
PARAM_NAMES = ("version", "want_arena", "model", "layout", "device_pages", "tp_rank", "tp_size", "extra_key",
               "state", "engine", "keys", "tokens", "pin", "states", "backup", "ok", "num_pages", "tier",
               "bytes", "depth", "namespace", "export", "max_bytes", "header", "import", "data", "have",
               "store", "put", "min", "max", "ttl_s", "priority", "key", "prefill_tokens_per_s")


@dataclass(slots=True)
class Frame:
    data: bytes
    replies: int  # replies owed: 1 for a complete frame, 0 for one that breaks the stream
    method: Any = None
    params: Any = None
    req_id: Any = None
    kind: str = ""

    def describe(self, limit: int = 400) -> str:
        return f"{self.kind}: method={self.method!r} id={self.req_id!r} params={_short(self.params, limit)}"


def _short(value: Any, limit: int) -> str:
    def shrink(v: Any, depth: int = 0) -> Any:
        if depth > 4:
            return "..."
        if isinstance(v, (bytes, bytearray)) and len(v) > 48:
            return f"<{len(v)} bytes {bytes(v[:16]).hex()}...>"
        if isinstance(v, str) and len(v) > 64:
            return v[:32] + f"...<{len(v)} chars>"
        if isinstance(v, dict):
            return {shrink(k, depth + 1): shrink(x, depth + 1) for k, x in list(v.items())[:16]}
        if isinstance(v, list):
            return [shrink(x, depth + 1) for x in v[:8]] + (["..."] if len(v) > 8 else [])
        return v
    text = repr(shrink(value))
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(slots=True)
class _Engine:
    engine_id: int
    salt: bytes
    layout: KVLayout
    device_pages: int
    hybrid: bool
    known: list[np.ndarray] = field(default_factory=list)  # token runs inserted (to match again)


@dataclass
class Context:
    """What the daemon handed out on this connection, for valid-looking follow-ups."""

    engines: list[_Engine] = field(default_factory=list)
    pins: list[int] = field(default_factory=list)
    backups: list[int] = field(default_factory=list)
    state_backups: list[int] = field(default_factory=list)
    exports: list[int] = field(default_factory=list)
    stores: list[int] = field(default_factory=list)  # keyed-page reservations
    puts: list[int] = field(default_factory=list)  # host puts
    imports: list[tuple[int, ExportHeader]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)  # salt hex of namespaces seen

    def learn(self, f: Frame, reply: dict) -> None:
        result = reply.get("result")
        if not isinstance(result, dict) or not isinstance(f.params, dict):
            return
        p = f.params
        if f.method == "register" and isinstance(result.get("engine"), int):
            try:
                layout = KVLayout.from_dict(p["layout"])
            except Exception:
                return
            self.engines.append(_Engine(result["engine"], result["salt"], layout, int(p["device_pages"]),
                                        p.get("state") is not None))
            self.namespaces.append(result["salt"].hex())
        elif f.method in ("match", "fetch") and isinstance(result.get("pin"), int):
            self.pins.append(result["pin"])
        elif f.method == "store" and isinstance(result.get("store"), int):
            self.stores.append(result["store"])
        elif f.method == "put" and isinstance(result.get("put"), int):
            self.puts.append(result["put"])
        elif f.method == "insert":
            backup = result.get("backup")
            if isinstance(backup, dict):
                self.backups.append(backup["id"])
            sb = result.get("state_backup")
            if isinstance(sb, dict):
                self.state_backups.append(sb["id"])
        elif f.method == "evict" and isinstance(result.get("backup"), dict):
            self.backups.append(result["backup"]["id"])
        elif f.method == "export_open" and isinstance(result.get("export"), int):
            self.exports.append(result["export"])
        elif f.method == "import_open" and isinstance(result.get("import"), int):
            try:
                from hicache.portable.format import decode_header
                self.imports.append((result["import"], decode_header(p["header"])))
            except Exception:
                pass
        for name in ("pins", "backups", "state_backups", "exports", "imports", "engines", "namespaces", "stores", "puts"):
            lst = getattr(self, name)
            if len(lst) > 64:
                del lst[:-32]


class FrameFuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._next_id = 1

    # -- values ----------------------------------------------------------------------------
    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def any_value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.randrange(14 if depth < 3 else 10)
        if kind == 0:
            return r.choice(INTS)
        if kind == 1:
            return r.randint(-1000, 100000)
        if kind == 2:
            return r.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308])
        if kind == 3:
            return r.choice(["", "host", "disk", "device", "gpu", "x" * r.randrange(1, 300), "é\u202e\U0001f600",
                             "\x00", "m", "fuzz"])
        if kind == 4:
            return r.randbytes(r.choice([0, 1, 3, 4, 15, 16, 17, 32, 64, 4096]))
        if kind == 5:
            return None
        if kind == 6:
            return r.choice([True, False])
        if kind == 7:
            return msgpack.ExtType(r.randrange(0, 127), r.randbytes(r.randrange(0, 9)))
        if kind == 8:
            return msgpack.Timestamp(r.randrange(0, 2**32), r.randrange(0, 10**9))
        if kind == 9:
            return b"\x00" * 16 * r.randrange(1, 8)
        if kind in (10, 11):
            return [self.any_value(depth + 1) for _ in range(r.randrange(0, 5))]
        return {r.choice(PARAM_NAMES + ("", "zz")): self.any_value(depth + 1) for _ in range(r.randrange(0, 5))}

    def _bytes_variant(self, value: bytes) -> bytes:
        r = self.rng
        choice = r.randrange(7)
        if choice == 0:
            return b""
        if choice == 1:
            return value[:-r.randrange(1, 4)] if value else b"\x01"
        if choice == 2:
            return value + r.randbytes(r.randrange(1, 4))
        if choice == 3:
            return value + r.randbytes(16 * r.randrange(1, 64))  # aligned, but more of them
        if choice == 4:
            return r.randbytes(len(value))
        if choice == 5:
            return b"\xff" * len(value)
        return r.randbytes(r.choice([1 << 16, 1 << 20]))  # far more than any request needs

    def _int_variant(self) -> int:
        return self.rng.choice(INTS)

    def mutate(self, params: dict, rounds: int) -> dict:
        r = self.rng
        p = dict(params)
        for _ in range(rounds):
            op = r.randrange(6)
            keys = list(p)
            if op == 0 and keys:
                del p[r.choice(keys)]
            elif op == 1:
                p[r.choice(PARAM_NAMES + ("extra", ""))] = self.any_value()
            elif op == 2 and keys:
                p[r.choice(keys)] = self.any_value()
            elif op == 3 and keys:
                k = r.choice(keys)
                v = p[k]
                if isinstance(v, bytes):
                    p[k] = self._bytes_variant(v)
                elif isinstance(v, bool):
                    p[k] = r.choice([0, 1, "true", None])
                elif isinstance(v, int):
                    p[k] = self._int_variant()
                elif isinstance(v, dict):
                    p[k] = self.mutate(v, r.randrange(1, 3))
                elif isinstance(v, list):
                    p[k] = [self.any_value() for _ in range(r.randrange(0, 4))] if r.random() < 0.5 else v * 1000
                else:
                    p[k] = self.any_value()
            elif op == 4 and keys:  # a known parameter of another method
                p[r.choice(PARAM_NAMES)] = p[r.choice(keys)]
            else:
                for k in keys:
                    if isinstance(p[k], int) and not isinstance(p[k], bool):
                        p[k] = self._int_variant()
        return p

    # -- valid requests ----------------------------------------------------------------------
    def _tokens(self, n_pages: int, page_size: int, eng: _Engine | None = None) -> np.ndarray:
        r = self.rng
        if eng is not None and eng.known and r.random() < 0.6:
            base = r.choice(eng.known)
            keep = r.randrange(0, len(base) // page_size + 1) * page_size
            tail = np.frombuffer(r.randbytes(4 * n_pages * page_size), dtype="<i4") % 50000
            return np.concatenate([base[:keep], tail]).astype(np.int32)[:max(keep, n_pages * page_size)]
        return (np.frombuffer(r.randbytes(4 * n_pages * page_size), dtype="<i4") % 50000).astype(np.int32)

    def _engine(self, ctx: Context) -> _Engine | None:
        return self.rng.choice(ctx.engines) if ctx.engines else None

    def valid_params(self, method: str, ctx: Context) -> dict:
        r = self.rng
        eng = self._engine(ctx)
        eid = eng.engine_id if eng else r.randrange(1, 50)
        if method == "hello":
            return {"version": PROTOCOL_VERSION, "want_arena": r.random() < 0.2}
        if method == "register":
            layout = r.choice(LAYOUTS)
            p = {"model": r.choice(["fuzz-a", "fuzz-b", f"fuzz-{r.randrange(1000)}"]), "layout": layout.to_dict(),
                 "device_pages": r.choice([8, 64, 256, 1024]), "tp_rank": 0, "tp_size": 1,
                 "extra_key": r.choice(["", "tenant"])}
            if r.random() < 0.2:
                p["state"] = STATE.to_dict()
            if r.random() < 0.3:  # the engine's prefill rate (fetch or recompute)
                p["prefill_tokens_per_s"] = r.choice([0, 1.0, 5e4, 1e12])
            return p
        if method in ("unregister",):
            return {"engine": eid}
        if method == "report":  # the prefill rate, from a huge one (its matches stop at host) to none
            return {"engine": eid, "prefill_tokens_per_s": r.choice([0, 0.5, 1e4, 1e12, r.uniform(0, 1e6)])}
        if method == "map_slabs":  # the host slabs of the engine's namespace it does not map yet
            return {"engine": eid, "have": [[r.randrange(0, 64), r.randrange(0, 4)] for _ in range(r.randrange(0, 4))]}
        if method == "match":
            ps = eng.layout.page_size if eng else 4
            toks = self._tokens(r.randrange(0, 24), ps, eng)
            return {"engine": eid, "keys": b"".join(page_keys(eng.salt if eng else r.randbytes(16), toks, ps))}
        if method in ("exists", "fetch", "store"):  # keyed pages: named keys, each from the salt
            ps = eng.layout.page_size if eng else 4
            toks = self._tokens(r.randrange(0, 24), ps, eng)
            salt = eng.salt if eng else r.randbytes(16)
            keys = [k for i in range(len(toks) // ps) for k in page_keys(salt, toks[i * ps:(i + 1) * ps], ps)]
            p = {"engine": eid, "keys": b"".join(keys)}
            if method == "store":
                p["tokens"] = toks[:len(keys) * ps].astype("<i4").tobytes()
                if r.random() < 0.5:  # the page before the batch: stored, unknown, or malformed
                    p["parent"] = r.choice([keys[-1] if keys else r.randbytes(16), r.randbytes(16), r.randbytes(5)])
            return p
        if method in ("pin", "unpin", "prioritize"):  # a prefix an engine stored (or not), by keys or tokens
            ps = eng.layout.page_size if eng else 4
            toks = self._tokens(r.randrange(0, 12), ps, eng)
            p = {"engine": eid} if r.random() < 0.7 else {"namespace": r.choice(ctx.namespaces or ["fuzz-a"])[:8]}
            if r.random() < 0.5:
                p["keys"] = b"".join(page_keys(eng.salt if eng else r.randbytes(16), toks, ps))
            else:
                p["tokens"] = toks.astype("<i4").tobytes()
            if r.random() < 0.7:
                p["tier"] = r.choice(["host", "disk"])
            if method == "pin":
                p["ttl_s"] = r.choice([0.01, 1, 60.0, 3600])
                if r.random() < 0.5:
                    p["priority"] = r.randrange(-5, 6)
            if method == "prioritize":
                p["priority"] = r.randrange(-5, 6)
                if r.random() < 0.5:
                    p["ttl_s"] = r.choice([0.01, 1, 60.0, 3600])
            return p
        if method == "put":  # a chained prefix, as insert sends it, without device pages
            ps = eng.layout.page_size if eng else 4
            toks = self._tokens(r.randrange(0, 24), ps, eng)
            keys = page_keys(eng.salt if eng else r.randbytes(16), toks, ps)
            return {"engine": eid, "keys": b"".join(keys), "tokens": toks[:len(keys) * ps].astype("<i4").tobytes()}
        if method == "put_done":
            return {"engine": eid, "put": r.choice(ctx.puts) if ctx.puts else r.randrange(1, 100),
                    "ok": r.random() < 0.8}
        if method == "store_done":
            return {"store": r.choice(ctx.stores) if ctx.stores else r.randrange(1, 100), "ok": r.random() < 0.8}
        if method in ("load", "release"):
            return {"pin": r.choice(ctx.pins) if ctx.pins else r.randrange(1, 100)}
        if method == "load_done":
            n = r.randrange(0, 8)
            top = min(eng.device_pages, 2**31 - 1) if eng else 64  # ids travel as int32
            return {"pin": r.choice(ctx.pins) if ctx.pins else r.randrange(1, 100),
                    "device_pages": np.asarray(r.sample(range(1, top + 1), min(n, top)), "<i4").tobytes()}
        if method == "insert":
            ps = eng.layout.page_size if eng else 4
            top = min(eng.device_pages, 2**31 - 1) if eng else 64
            n = r.randrange(1, min(24, top) + 1)
            toks = self._tokens(n, ps, eng)
            if eng is not None:
                eng.known.append(toks)
                del eng.known[:-8]
            p = {"engine": eid, "keys": b"".join(page_keys(eng.salt if eng else r.randbytes(16), toks, ps)),
                 "tokens": toks.astype("<i4").tobytes(),
                 "device_pages": np.asarray(r.sample(range(1, top + 1), n), "<i4").tobytes()}
            if ctx.pins and r.random() < 0.3:
                p["pin"] = r.choice(ctx.pins)
            if eng is not None and eng.hybrid and r.random() < 0.5:
                p["states"] = [[STATE.chunk_size * (i + 1), i] for i in range(r.randrange(0, 3))]
            return p
        if method in ("backup_done", "state_backup_done"):
            pool = ctx.backups if method == "backup_done" else ctx.state_backups
            return {"backup": r.choice(pool) if pool else r.randrange(1, 100), "ok": r.random() < 0.8}
        if method == "evict":
            return {"engine": eid, "num_pages": r.randrange(0, 32)}
        if method == "flush":
            return {"tier": r.choice(["host", "disk"])}
        if method == "evict_tier":
            return {"tier": r.choice(["host", "disk"]), "bytes": r.choice([0, 1, 4096, 1 << 20])}
        if method == "ls":
            return {"depth": r.randrange(0, 6)}
        if method in ("quota_set", "quota_clear"):  # a tenant by model (and extra key) or by salt prefix
            p = ({"model": r.choice(["fuzz-a", "fuzz-b"])} if r.random() < 0.7 or not ctx.namespaces
                 else {"namespace": r.choice(ctx.namespaces)[:r.randrange(4, 33)]})
            if "model" in p and r.random() < 0.5:
                p["extra_key"] = r.choice(["", "tenant"])
            if method == "quota_clear":
                return p | ({"tier": r.choice(["host", "disk"])} if r.random() < 0.5 else {})
            return p | {"tier": r.choice(["host", "disk"]), "min": r.choice(["0", "5%", "1MiB", 0, 4096]),
                        "max": r.choice([None, "50%", "100%", "8MiB"])}
        if method == "remote_flush":  # the fuzzed daemon has no remote tier: refused, never INTERNAL
            return {"namespace": r.choice(ctx.namespaces)[:r.randrange(4, 33)] if ctx.namespaces else "fuzz-a"}
        if method == "export_open":
            return {"namespace": r.choice(ctx.namespaces)[:r.randrange(4, 33)] if ctx.namespaces else "fuzz-a"}
        if method == "export_next":
            return {"export": r.choice(ctx.exports) if ctx.exports else r.randrange(1, 20),
                    "max_bytes": r.choice([1, 4096, 1 << 20])}
        if method == "import_open":
            layout = r.choice(LAYOUTS)
            ns = Namespace(r.choice(["fuzz-a", "fuzz-import"]), layout)
            return {"header": ExportHeader.for_namespace(ns).encode()}
        if method == "import_pages":
            if ctx.imports:
                iid, header = r.choice(ctx.imports)
                return {"import": iid, "data": self._chunk(header)}
            return {"import": r.randrange(1, 20), "data": r.randbytes(r.randrange(0, 256))}
        return {}  # stats, subscribe, doctor

    def _chunk(self, header: ExportHeader) -> bytes:
        """A well-formed run of page records (sometimes closed by an end record)."""
        r = self.rng
        ps = header.page_size
        toks = self._tokens(r.randrange(1, 5), ps)
        keys = page_keys(header.salt, toks, ps)
        parts, parent = [], None
        for i, key in enumerate(keys):
            parts.append(encode_page(key, parent, toks[i * ps:(i + 1) * ps].astype("<i4").tobytes(),
                                     r.randbytes(header.page_bytes)))
            parent = key
        if r.random() < 0.2:
            parts.append(encode_end(len(keys), len(keys) * header.page_bytes))
        return b"".join(parts)

    # -- frames ---------------------------------------------------------------------------
    def method(self) -> str:
        while True:
            m = self.rng.choice(METHODS)
            if self.rng.random() < RARE.get(m, 1.0):
                return m

    @staticmethod
    def _pack(msg: Any) -> bytes:
        return msgpack.packb(msg, use_bin_type=True)

    def _complete(self, body: bytes, kind: str, method: Any = None, params: Any = None, req_id: Any = None
                  ) -> Frame:
        return Frame(HEADER.pack(len(body)) + body, 1, method, params, req_id, kind)

    def request(self, method: str, params: Any, kind: str) -> Frame:
        req_id = self._id()
        return self._complete(self._pack({"id": req_id, "method": method, "params": params}), kind, method,
                              params, req_id)

    def hello(self) -> Frame:
        return self.request("hello", {"version": PROTOCOL_VERSION, "want_arena": self.rng.random() < 0.3}, "hello")

    def next_frame(self, ctx: Context) -> Frame:
        r = self.rng
        x = r.random()
        if x < 0.22:
            return self.request(m := self.method(), self.valid_params(m, ctx), "valid")
        if x < 0.62:
            m = self.method()
            return self.request(m, self.mutate(self.valid_params(m, ctx), r.randrange(1, 4)), "mutated")
        if x < 0.70:
            m = self.method()
            return self.request(m, {k: self.any_value() for k in r.sample(PARAM_NAMES, r.randrange(0, 5))},
                                "random-params")
        if x < 0.80:
            return self.bad_envelope(ctx)
        if x < 0.90:
            return self.garbage_body()
        if x < 0.95:
            return self.deep_nesting()
        if x < 0.98:
            return self.huge(ctx)
        return self.request(r.choice(["", "Stats", "stats ", "__init__", "hello\x00", "x" * 10000,
                                      "export_open_", "_get", "build_handlers"]), {}, "unknown-method")

    def bad_envelope(self, ctx: Context) -> Frame:
        r = self.rng
        m = self.method()
        msg: dict[Any, Any] = {"id": self._id(), "method": m, "params": self.valid_params(m, ctx)}
        what = r.randrange(6)
        if what == 0:
            msg["id"] = r.choice(["1", 1.0, None, True, [1], {"id": 1}, b"\x01", 2**64 - 1, -2**63, -1])
        elif what == 1:
            del msg[r.choice(["id", "method", "params"])]
        elif what == 2:
            msg["method"] = r.choice([None, 7, b"stats", ["stats"], {"m": 1}, True])
        elif what == 3:
            msg["params"] = r.choice([None, [], [1, 2], "params", 5, b"p", True])
        elif what == 4:
            msg[r.choice(["extra", "result", "error", "event"])] = self.any_value()
        else:
            msg = {"method": m, "id": msg["id"], "params": msg["params"], "id2": msg["id"]}
        return self._complete(self._pack(msg), "bad-envelope", msg.get("method"), msg.get("params"), msg.get("id"))

    def garbage_body(self) -> Frame:
        r = self.rng
        valid = self._pack({"id": self._id(), "method": "stats", "params": {}})
        what = r.randrange(10)
        if what == 0:
            body = r.randbytes(r.randrange(0, 200))
        elif what == 1:
            body = valid[:r.randrange(0, len(valid))]  # a truncated map inside a complete frame
        elif what == 2:
            body = valid + r.randbytes(r.randrange(1, 16))  # trailing bytes after the map
        elif what == 3:
            body = b"\xc1" * r.randrange(1, 8)  # never valid msgpack
        elif what == 4:
            body = self._pack(r.choice([[1, 2, 3], 5, "stats", None, b"x", 1.5]))
        elif what == 5:  # a str that is not UTF-8
            body = b"\x83\xa2id\x01\xa6method\xa5st\xff\xfes\xa6params\x80"
        elif what == 6:  # a map with an int key (strict_map_key refuses it)
            body = b"\x84\xa2id\x01\xa6method\xa5stats\xa6params\x80\x07\x07"
        elif what == 7:  # headers declaring huge strings / arrays / maps with nothing behind them
            body = b"\x83\xa2id\x01\xa6method\xa5stats\xa6params" + r.choice(
                [b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                 b"\xdd\x00\x10\x00\x00" + b"\xc0" * 16])
        elif what == 8:
            body = b""
        else:  # an ext type with a bogus timestamp body
            body = b"\x83\xa2id\x01\xa6method\xa5stats\xa6params\xd7\xff" + r.randbytes(8)
        return self._complete(body, "garbage-body")

    def deep_nesting(self) -> Frame:
        r = self.rng
        depth = r.choice([64, 500, 2000, 20000, 200000])
        opener, leaf = r.choice([(b"\x91", b"\xc0"), (b"\x81\xa1k", b"\x01")])  # [[[...]]] or {"k": {"k": ...}}
        req_id = self._id()
        method = r.choice(METHODS)
        head = (b"\x83" + self._pack("id") + self._pack(req_id) + self._pack("method") + self._pack(method)
                + self._pack("params") + b"\x81" + self._pack(r.choice(PARAM_NAMES)))
        return self._complete(head + opener * depth + leaf, "deep-nesting", method, f"<nested {depth} deep>", req_id)

    def huge(self, ctx: Context) -> Frame:
        r = self.rng
        m = r.choice(["match", "insert", "load_done", "import_pages", "register", "stats", "export_open"])
        p = self.valid_params(m, ctx)
        size = r.choice([1 << 20, 4 << 20, 16 << 20])
        if m == "match":
            p["keys"] = r.randbytes(size - size % 16)
        elif m == "insert":
            n = size // 16
            p["keys"] = r.randbytes(n * 16)
            p["tokens"] = r.randbytes(r.choice([n * 16, n * 4 * 4 + 4]))
            p["device_pages"] = np.arange(1, n + 1, dtype="<i4").tobytes()
        elif m == "load_done":
            p["device_pages"] = np.arange(1, size // 4 + 1, dtype="<i4").tobytes()
        elif m == "import_pages":
            p["data"] = r.randbytes(size)
        elif m == "register":
            p["device_pages"] = r.choice([2**31 - 1, 2**30, 2**40, 2**63 - 1])
            p["model"] = "m" * r.choice([1 << 16, 1 << 20])
        elif m == "export_open":
            p["namespace"] = "a" * size
        else:
            p["pad"] = b"\x00" * size
        return self.request(m, p, "huge")

    def stream_breaker(self) -> Frame:
        """Ends the connection: a length prefix over any cap, or a frame cut short."""
        r = self.rng
        if r.random() < 0.5:
            n = r.choice([0xFFFFFFFF, 0x80000000, (64 << 20) + 1, 1 << 30])
            return Frame(HEADER.pack(n) + r.randbytes(r.randrange(0, 64)), 0, None, None, None, "oversized-prefix")
        body = self._pack({"id": self._id(), "method": "stats", "params": {"pad": r.randbytes(r.randrange(0, 4096))}})
        cut = r.randrange(0, len(body) + 4)
        data = (HEADER.pack(len(body)) + body)[:cut]
        return Frame(data, 0, "stats", None, None, "truncated-frame")
