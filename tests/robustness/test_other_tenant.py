"""A second, unprivileged tenant must get no byte of another tenant's KV, by any path.

Tenant A (root, an engine in this process) stores pages; tenant B (a forked child
running as an unused uid, allowed to connect) runs the real engine path and then
tries every way in: the host memory it is sent (read, write, truncate), the admin
calls (flush, evict_tier, export, import into A's namespace), `ls`, events, and
A's keys in its own namespace. After each step A's pages must still be served
exactly as A stored them. All breaches are listed together in the failure.
"""

from __future__ import annotations

import os
import pwd
import signal
import tempfile
import time

import numpy as np
import pytest
import torch

from hicache.index.keys import Namespace, page_keys

from tests.daemon.engine_worker import page_content
from tests.robustness import tenant
from tests.robustness.contracts import FORBIDDEN, is_refusal
from tests.robustness.engines import LAYOUT, conversation, engine, load_and_check, store
from tests.robustness.wire import admin_call, served_stats

# On each of the daemon's frame loops (tests/conftest.py).
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a tenant as another user"),
              pytest.mark.usefixtures("frame_loop")]

A_MODEL, A_EXTRA = "tenant-a", "a-secret"
STEP_S = 120.0  # generous per step of the child on a loaded machine


def unused_uid(start: int = 48123) -> int:
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def needles(keys: list[bytes]) -> list[str]:
    """The first bytes each page holds in host memory (its layer-0 K rows), hex."""
    shape = (LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [page_content(k, 0, shape, torch.float16).view(torch.uint8).numpy().tobytes()[:tenant.NEEDLE_BYTES].hex()
            for k in keys]


def a_keys(convs: list[np.ndarray]) -> list[bytes]:
    salt = Namespace(A_MODEL, LAYOUT, extra_key=A_EXTRA).salt()
    return sorted({k for t in convs for k in page_keys(salt, t, LAYOUT.page_size)})


def check_a(socket: str, convs: list[np.ndarray], when: str, breaches: list[str]) -> None:
    cache = engine(socket, model=A_MODEL, extra_key=A_EXTRA, pool_pages=1024)
    try:
        for tokens in convs:
            r = load_and_check(cache, tokens)
            if r["bad_pages"] or r["loaded"] != len(tokens) // LAYOUT.page_size:
                breaches.append(f"{when}: A's conversation served {r['loaded']} of {len(tokens) // LAYOUT.page_size} "
                                f"pages, {r['bad_pages']} of them not as A stored them ({r})")
    finally:
        cache.close()


def test_another_tenant_gets_no_byte_of_my_pages_by_any_path(daemon_factory):
    public = tempfile.mkdtemp(prefix="hicache-tenants-")  # pytest's tmp dirs are private to root
    os.chmod(public, 0o755)
    uid = unused_uid()
    d = daemon_factory("--host-capacity", "8MiB", "--disk-capacity", "128MiB",
                       env={"HICACHE_ALLOWED_UIDS": f"0,{uid}", "HICACHE_LOAD_POLICY": "wait_complete"})
    d.socket = os.path.join(public, "hicache.sock")
    d.start("--socket", d.socket)
    os.chmod(d.socket, 0o666)  # the peer check alone decides who is served
    a_salt = Namespace(A_MODEL, LAYOUT, extra_key=A_EXTRA).salt()
    convs = [conversation(100 + i, np.random.default_rng(i)) for i in range(3)]
    a_cache = engine(d.socket, model=A_MODEL, extra_key=A_EXTRA)
    try:
        for tokens in convs:
            store(a_cache, tokens)
    finally:
        a_cache.close()
    deadline = time.monotonic() + 30
    while served_stats(d.socket)["tiers"]["disk"]["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.02)
    keys = a_keys(convs)
    info = {"salt": a_salt.hex(), "model": A_MODEL, "extra_key": A_EXTRA, "layout": LAYOUT.to_dict(),
            "needles": needles(keys), "keys": [k.hex() for k in keys],
            "first_tokens": convs[0][:LAYOUT.page_size].tolist(),
            "first_keys": b"".join(page_keys(a_salt, convs[0], LAYOUT.page_size)).hex()}

    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        tenant.run(d.socket, uid, info, to_child_r, from_child_w)  # never returns
    os.close(to_child_r)
    os.close(from_child_w)
    inbox = tenant.Lines(from_child_r)
    breaches: list[str] = []

    def expect(phase: str) -> dict:
        try:
            msg = inbox.recv(STEP_S)
        except (TimeoutError, EOFError) as e:
            raise AssertionError(f"tenant B stopped before {phase!r}: {e}; breaches so far: {breaches}") from None
        assert "error" not in msg, f"tenant B failed before {phase!r}:\n{msg['error']}"
        assert msg.get("phase") == phase, msg
        return msg

    try:
        mapped = expect("mapped")
        assert mapped["own_load"]["bad_pages"] == 0, f"tenant B cannot even use its own pages: {mapped}"
        if mapped["a_pages_readable"]:
            breaches.append(f"B read {mapped['a_pages_readable']} of A's {len(keys)} pages through the "
                            f"memfd(s) it was sent (sizes {mapped['memfds']})")
        check_a(d.socket, convs, "after B wrote over all host memory it was sent", breaches)
        tenant.send(to_child_w, {"go": True})

        rpc = expect("subscribed")["rpc"]
        for name in ("flush host", "flush disk", "evict_tier host", "evict_tier disk"):
            if not is_refusal({"error": {"code": rpc[name]}}):
                breaches.append(f"B's {name}: {rpc[name]} (want {FORBIDDEN})")
        if rpc["export_open A"] not in (FORBIDDEN, "NOT_FOUND"):
            breaches.append(f"B's export of A's namespace: {rpc['export_open A']}, "
                            f"{rpc.get('export A pages readable', 0)} of A's pages in it")
        if rpc["import_open A"] != FORBIDDEN and rpc.get("import_pages A") != FORBIDDEN:
            breaches.append(f"B imported a page into A's namespace: import_open {rpc['import_open A']}, "
                            f"import_pages {rpc.get('import_pages A')}")
        if rpc.get("ls shows A"):
            breaches.append("B's ls lists A's namespace")
        if rpc["match A keys"] not in (0, "NOT_FOUND", FORBIDDEN):
            breaches.append(f"A's keys matched {rpc['match A keys']} pages in B's namespace")
        more = [conversation(200, np.random.default_rng(200))]  # events B must not see
        a_cache = engine(d.socket, model=A_MODEL, extra_key=A_EXTRA)
        try:
            store(a_cache, more[0])
        finally:
            a_cache.close()
        tenant.send(to_child_w, {"go": True})
        events = expect("events")["events"]
        if events.get("events about A"):
            breaches.append(f"B's subscription showed it {events['events about A']} events of A's namespace")

        # A takes all host memory over, from a flushed host tier: B's old mappings must show none of it
        admin_call(d.socket, "flush", {"tier": "host"})
        # 12 conversations of ~1000 pages: 12k pages of 768 B, more than the 8 MiB host tier holds
        refill = [np.concatenate([conversation(300 + i, np.random.default_rng(300 + i)),
                                  np.random.default_rng(400 + i).integers(0, 50000, 4000, dtype=np.int32)])
                  for i in range(12)]
        a_cache = engine(d.socket, model=A_MODEL, extra_key=A_EXTRA, pool_pages=1100)
        try:
            for tokens in refill:
                store(a_cache, tokens)
        finally:
            a_cache.close()
        tenant.send(to_child_w, {"needles": needles(a_keys(refill))})
        last = expect("refilled")
        if last["a_pages_readable_via_old_mappings"]:
            breaches.append(f"B's old mappings showed {last['a_pages_readable_via_old_mappings']} of the pages A "
                            f"stored after B's memory was taken back")
        if last["truncated"]:
            breaches.append(f"B resized host memory it was sent: {last['truncated']}")
        os.waitpid(pid, 0)
        pid = 0
        assert d.running, f"the daemon died of tenant B:\n{d.read_log()[-3000:]}"
        admin_call(d.socket, "flush", {"tier": "host"})  # A's first pages now come from disk
        check_a(d.socket, convs, "in the end (from disk)", breaches)
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(to_child_w)
        os.close(from_child_r)
    assert not breaches, "tenant B got at tenant A's pages:\n  " + "\n  ".join(breaches)
