"""hello first; admin methods for admin peers only; a peer sees only its own namespaces (defect 13)."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest

from hicache.client.connection import RpcConnection
from hicache.errors import ClientError
from hicache.index.keys import page_keys
from hicache.rpc.framing import ids_to_bytes
from hicache.rpc.protocol import PROTOCOL_VERSION

from tests.rpc.wire import LAYOUT, AsUser, raw, request, start_public

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")

ADMIN_CALLS = [("flush", {"tier": "host"}), ("evict_tier", {"tier": "host", "bytes": 1 << 30}),
               ("doctor", {}), ("export_open", {"namespace": "tenant-a"}), ("export_next", {"export": 1}),
               ("import_open", {"header": b"x"}), ("import_pages", {"import": 1, "data": b""}),
               ("remote_flush", {"namespace": "tenant-a"}), ("settle", {}),
               ("quota_set", {"model": "tenant-a", "tier": "host", "min": "10%"}),
               ("quota_clear", {"model": "tenant-a"}), ("quota_list", {})]


def store(conn: RpcConnection, model: str, seed: int, pages: int = 8) -> dict:
    """Register `model` and insert one sequence of `pages` pages (write-through: a host copy follows)."""
    reg = conn.call("register", {"model": model, "layout": LAYOUT.to_dict(), "device_pages": 256})
    tokens = np.full(pages * 4, seed, dtype=np.int32)
    blob = b"".join(page_keys(reg["salt"], tokens, 4))
    r = conn.call("insert", {"engine": reg["engine"], "keys": blob, "tokens": tokens.tobytes(),
                             "device_pages": ids_to_bytes(range(1, pages + 1))})
    if r["backup"] is not None:
        conn.call("backup_done", {"backup": r["backup"]["id"]})
    return reg


def code_of(conn: RpcConnection, method: str, params: dict) -> str:
    try:
        conn.call(method, params)
    except ClientError as e:
        return e.code
    return "OK"


def test_nothing_is_served_before_hello(daemon):
    s = raw(daemon.socket)
    for i, (method, params) in enumerate([("stats", {}), ("register", {"model": "m", "layout": LAYOUT.to_dict(),
                                                                         "device_pages": 8}),
                                          ("ls", {}), ("flush", {"tier": "host"}), ("no_such_method", {})]):
        assert request(s, i, method, params)["error"]["code"] == "HELLO_REQUIRED"
    assert request(s, 10, "hello", {"version": 999})["error"]["code"] == "VERSION"
    assert request(s, 11, "stats")["error"]["code"] == "HELLO_REQUIRED"  # a failed hello is no hello
    assert "result" in request(s, 12, "hello", {"version": PROTOCOL_VERSION})
    assert "tiers" in request(s, 13, "stats")["result"]
    s.close()


@needs_root
def test_a_non_admin_peer_cannot_flush_import_export_or_look_into_other_tenants(daemon_factory):
    d = start_public(daemon_factory, "--host-capacity", "16MiB", "--no-disk",
                     env={"HICACHE_ALLOWED_UIDS": "0,4343,4444", "HICACHE_ADMIN_GIDS": "4242"})
    root = RpcConnection.connect(d.socket)
    root.hello()
    a = store(root, "tenant-a", seed=1)

    def tenant_b(ch: AsUser) -> dict:
        c = RpcConnection.connect(d.socket, timeout_s=10)
        c.hello()
        sub = RpcConnection.connect(d.socket, timeout_s=10)
        sub.hello()
        out = {"before_register": c.call("ls", {"depth": 1})["namespaces"]}
        b = store(c, "tenant-b", seed=2)
        sub.call("register", {"model": "tenant-b", "layout": LAYOUT.to_dict(), "device_pages": 8})
        sub.call("subscribe")
        out["admin"] = {method: code_of(c, method, params) for method, params in ADMIN_CALLS}
        out["ls"] = [ns["model"] for ns in c.call("ls", {"depth": 2})["namespaces"]]
        st = c.call("stats")
        out["engines"] = [(e["engine"], e["model"]) for e in st["engines"]]
        out["namespaces"] = st["namespaces"]
        ch.say("subscribed")
        assert ch.hear() == "a-changed"
        store(c, "tenant-b", seed=3, pages=2)  # our own marker: every event before it has arrived
        seen = []
        while True:
            ev = sub.read_event()
            seen.append(ev["namespace"])
            if ev["namespace"] == b["salt"].hex() and ev["tier"] == "host":
                break
        out["events"] = sorted(set(seen))
        out["b_salt"] = b["salt"].hex()
        return out

    child = AsUser(4343, 4343, [], tenant_b)
    assert child.hear() == "subscribed"
    # the refused calls changed nothing: tenant a's host pages are all there
    spaces = {ns["model"]: ns for ns in root.call("ls", {"depth": 1})["namespaces"]}
    assert spaces["tenant-a"]["pages"]["host"] == 8 and set(spaces) == {"tenant-a", "tenant-b"}  # root sees all
    assert {e["model"] for e in root.call("stats")["engines"]} == {"tenant-a", "tenant-b"}
    store(root, "tenant-a", seed=4)  # events of tenant a's namespace while b listens
    root.call("flush", {"tier": "host"})  # and an admin flush: removal events of both namespaces
    child.say("a-changed")
    out = child.result()

    assert out["before_register"] == []  # a peer that registered nothing sees no namespace
    assert set(out["admin"].values()) == {"FORBIDDEN"}, out["admin"]
    assert out["ls"] == ["tenant-b"]
    assert [m for _, m in out["engines"]] == ["tenant-b"]  # its connection's engine only (not even sub's)
    assert out["namespaces"] == 2  # aggregate counts stay
    assert out["events"] == [out["b_salt"]]  # nothing of tenant a's namespace
    assert a["engine"] in {e["engine"] for e in root.call("stats")["engines"]}
    root.close()


@needs_root
def test_a_member_of_an_admin_group_is_an_admin(daemon_factory):
    d = start_public(daemon_factory, "--host-capacity", "16MiB", "--no-disk",
                     env={"HICACHE_ALLOWED_UIDS": "0,4444", "HICACHE_ADMIN_GIDS": "4242"})
    root = RpcConnection.connect(d.socket)
    root.hello()
    store(root, "tenant-a", seed=1)
    assert root.call("stats")["tiers"]["host"]["used_bytes"] > 0

    def operator(ch: AsUser) -> dict:
        c = RpcConnection.connect(d.socket, timeout_s=10)
        c.hello()
        return {"ls": [ns["model"] for ns in c.call("ls", {"depth": 1})["namespaces"]],
                "flush": c.call("flush", {"tier": "host"})["pages"],
                "engines": len(c.call("stats")["engines"])}

    out = AsUser(4444, 4444, [4242], operator).result()  # the admin group as a supplementary group
    assert out == {"ls": ["tenant-a"], "flush": 8, "engines": 1}
    assert root.call("stats")["tiers"]["host"]["used_bytes"] == 0
    root.close()


def test_engines_act_only_on_what_their_connection_registered(daemon):
    a = RpcConnection.connect(daemon.socket)
    a.hello()
    reg = a.call("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 64})
    tokens = np.arange(16, dtype=np.int32)
    blob = b"".join(page_keys(reg["salt"], tokens, 4))
    ins = a.call("insert", {"engine": reg["engine"], "keys": blob, "tokens": tokens.tobytes(),
                            "device_pages": ids_to_bytes(range(1, 5))})
    m = a.call("match", {"engine": reg["engine"], "keys": blob})
    b = RpcConnection.connect(daemon.socket)
    b.hello()
    mine = b.call("register", {"model": "m", "layout": LAYOUT.to_dict(), "device_pages": 64})["engine"]
    theirs = {"engine": reg["engine"], "keys": blob, "tokens": tokens.tobytes(),
              "device_pages": ids_to_bytes(range(1, 5))}
    calls = [("backup_done", {"backup": ins["backup"]["id"]}), ("load_done", {"pin": m["pin"], "device_pages": b""}),
             ("release", {"pin": m["pin"]}), ("unregister", {"engine": reg["engine"]}),
             ("insert", theirs), ("insert", {**theirs, "engine": mine, "pin": m["pin"]}),
             ("evict", {"engine": reg["engine"], "num_pages": 4}), ("state_backup_done", {"backup": 1}),
             ("exists", {"engine": reg["engine"], "keys": blob}), ("fetch", {"engine": reg["engine"], "keys": blob}),
             ("store", {"engine": reg["engine"], "keys": blob, "tokens": tokens.tobytes()}),
             ("store_done", {"store": 1})]
    for method, params in calls:
        assert code_of(b, method, params) in ("NOT_FOUND", "NOT_REGISTERED"), method
    # all of it still A's and whole: its backup completes and its pin releases
    assert a.call("backup_done", {"backup": ins["backup"]["id"]})["free_pages"] == b""
    a.call("release", {"pin": m["pin"]})
    st = a.call("stats")
    assert st["pins"] == 0 and st["tiers"]["host"]["pages"] == 4
    a.close()
    b.close()


def test_hello_first_survives_garbage_before_it(daemon):
    s = raw(daemon.socket)
    s.sendall(len(b"\xc1").to_bytes(4, "big") + b"\xc1")  # undecodable: BAD_REQUEST, not served
    assert request(s, 1, "stats")["error"]["code"] == "HELLO_REQUIRED"
    s.sendall(len(msgpack.packb([1])).to_bytes(4, "big") + msgpack.packb([1]))
    assert request(s, 2, "hello", {"version": PROTOCOL_VERSION})["result"]["version"] == PROTOCOL_VERSION
    s.close()
