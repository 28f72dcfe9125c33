"""Tenant B: a forked child running as another (unprivileged) uid that tries to read
and write tenant A's pages through everything the daemon gives it.

It runs the real engine path (EngineCache: hello, register, the host memory it is
sent), then looks at every memfd it holds, and calls the admin and cross-namespace
methods on a raw connection. It reports what it saw to the parent as JSON lines;
the parent (tests/robustness/test_other_tenant.py) decides what is a breach.
No exec: the interpreter under /root is not readable by other users.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import traceback
from typing import Any

import numpy as np

NEEDLE_BYTES = 16  # the first bytes of a page's layer-0 K rows: random, so never found by chance


# -- pipes --------------------------------------------------------------------------------
def send(fd: int, msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


class Lines:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def recv(self, timeout_s: float) -> dict:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout_s)
            if not ready:
                raise TimeoutError(f"no message in {timeout_s:.0f}s")
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError("the other side closed the pipe")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# -- memory ---------------------------------------------------------------------------------
def memfds() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                out.append(int(name))
        except OSError:
            pass
    return sorted(out)


def count_needles(buf: Any, needles: set[bytes]) -> int:
    return len(found_needles(buf, needles))


def found_needles(buf: Any, needles: set[bytes]) -> set[bytes]:
    """The needles that occur anywhere in buf (any alignment)."""
    data = np.frombuffer(buf, dtype=np.uint8)
    heads = np.array(sorted({int.from_bytes(n[:8], "little") for n in needles}), dtype=np.uint64)
    found: set[bytes] = set()
    for a in range(8):
        n = (len(data) - a - NEEDLE_BYTES) // 8
        if n <= 0:
            continue
        words = data[a:a + 8 * n].view("<u8")
        for i in np.flatnonzero(np.isin(words, heads)):
            at = a + 8 * int(i)
            cand = bytes(data[at:at + NEEDLE_BYTES])
            if cand in needles:
                found.add(cand)
    return found


def map_all(fds: list[int]) -> list[tuple[int, int, mmap.mmap]]:
    out = []
    for fd in fds:
        size = os.fstat(fd).st_size
        if size:
            out.append((fd, size, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)))
    return out


def overwrite(fds: list[int]) -> list[str]:
    """Try to write 0x5A over every byte of every memfd; what succeeded."""
    done = []
    for fd in fds:
        size = os.fstat(fd).st_size
        try:
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            done.append(f"fd {fd}: mmap for writing refused ({e.strerror})")
            continue
        try:
            m[:] = b"\x5a" * size
            done.append(f"fd {fd}: wrote {size} bytes")
        finally:
            m.close()
    return done


def truncate(fds: list[int]) -> list[str]:
    ok = []
    for fd in fds:
        for size in (0, os.fstat(fd).st_size + (1 << 20)):
            try:
                os.ftruncate(fd, size)
                ok.append(f"fd {fd}: ftruncate to {size} succeeded")
            except OSError:
                pass
    return ok


# -- the child --------------------------------------------------------------------------
def run(socket: str, uid: int, a: dict, from_parent: int, to_parent: int) -> None:
    """Never returns: os._exit in the end, whatever happens."""
    try:
        keep = {from_parent, to_parent}
        for name in os.listdir("/proc/self/fd"):  # nothing of the parent's (its arena fds!) stays
            fd = int(name)
            if fd > 2 and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _preload()
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _tenant_b(socket, a, Lines(from_parent), to_parent)
    except BaseException:  # noqa: BLE001 - reported to the parent
        try:
            send(to_parent, {"error": traceback.format_exc()[-3000:]})
        except OSError:
            pass
    finally:
        os._exit(0)


def _preload() -> None:
    """Import what tenant B uses while the child can still read it: the interpreter's
    files under /root are closed to the uid it becomes, and whether the parent happened
    to import a module (xxhash, through portable_format) depends on the tests run before."""
    import torch  # noqa: F401

    import hicache.index.keys  # noqa: F401
    import hicache.layout  # noqa: F401
    import hicache.portable.format  # noqa: F401
    import tests.daemon.engine_worker  # noqa: F401
    import tests.robustness.contracts  # noqa: F401
    import tests.robustness.engines  # noqa: F401
    import tests.robustness.wire  # noqa: F401


def _tenant_b(socket: str, a: dict, inbox: Lines, out: int) -> None:
    import torch  # after fork, as DataLoader workers do: one intra-op thread

    torch.set_num_threads(1)
    from hicache.index.keys import Namespace, page_keys
    from hicache.layout import KVLayout
    from hicache.portable.format import ExportHeader, encode_end, encode_page

    from tests.daemon.engine_worker import load
    from tests.robustness.contracts import error_code
    from tests.robustness.engines import LAYOUT, conversation, engine, store
    from tests.robustness.wire import RawConn, WireEngine

    needles = {bytes.fromhex(h) for h in a["needles"]}
    # 1. the engine path: whatever host memory the daemon hands an engine of namespace B
    cache = engine(socket, pool_pages=256, model="tenant-b")
    if not cache.client.connected:
        raise RuntimeError("tenant B could not connect as an engine")
    mine = conversation(31337, np.random.default_rng(31337))
    store(cache, mine)
    own = load(cache, mine)
    fds = memfds()
    maps = map_all(fds)
    seen = len(set().union(*(found_needles(m, needles) for _, _, m in maps)))
    send(out, {"phase": "mapped", "own_load": own, "memfds": [s for _, s, _ in maps], "a_pages_readable": seen,
               "overwrote": overwrite(fds)})
    inbox.recv(120)  # the parent checked A's host pages after our writes

    # 2. the admin and cross-namespace methods
    a_ns = Namespace(a["model"], KVLayout.from_dict(a["layout"]), extra_key=a["extra_key"])
    rpc: dict[str, Any] = {}
    with RawConn(socket, timeout_s=30) as c:
        c.hello()
        for name, method, params in (("flush host", "flush", {"tier": "host"}),
                                     ("flush disk", "flush", {"tier": "disk"}),
                                     ("evict_tier host", "evict_tier", {"tier": "host", "bytes": 1 << 40}),
                                     ("evict_tier disk", "evict_tier", {"tier": "disk", "bytes": 1 << 40})):
            reply = c.call(method, params)
            rpc[name] = error_code(reply) or f"served: {reply.get('result')!r:.100}"
        reply = c.call("export_open", {"namespace": a["salt"]})
        rpc["export_open A"] = error_code(reply) or "served"
        if "result" in reply:
            data = b""
            for _ in range(1000):
                nxt = c.call("export_next", {"export": reply["result"]["export"], "max_bytes": 1 << 20})
                if "result" not in nxt:
                    break
                data += nxt["result"]["data"]
                if nxt["result"]["done"]:
                    break
            rpc["export A pages readable"] = count_needles(data, needles) if data else 0
        reply = c.call("import_open", {"header": ExportHeader.for_namespace(a_ns).encode()})
        rpc["import_open A"] = error_code(reply) or "served"
        if "result" in reply:
            toks = np.asarray(a["first_tokens"], dtype="<i4")
            key = page_keys(a_ns.salt(), toks, LAYOUT.page_size)[0]
            poison = encode_page(key, None, toks.tobytes(), b"\xee" * LAYOUT.page_bytes) + encode_end(1, LAYOUT.page_bytes)
            got = c.call("import_pages", {"import": reply["result"]["import"], "data": poison})
            rpc["import_pages A"] = error_code(got) or f"served: {got.get('result')!r:.100}"
        reply = c.call("ls", {"depth": 8})
        rpc["ls"] = error_code(reply) or "served"
        if "result" in reply:
            text = repr(reply["result"])
            rpc["ls shows A"] = a["salt"] in text or a["model"] in text
        # A's keys, in B's own namespace: keys alone must not reach another namespace
        eng = WireEngine(c, LAYOUT, 64, model="tenant-b")
        m = c.call("match", {"engine": eng.engine_id, "keys": bytes.fromhex(a["first_keys"])})
        r = m.get("result")
        rpc["match A keys"] = (len(r["device_pages"]) // 4 + len(r["host_pages"]) // 4 + r["disk_len"]
                                 if r else error_code(m))

    # 3. events: subscribe on the connection of an engine of B's own, let A store, then our
    # own insert marks the end of what A's store could have shown us
    events: dict[str, Any] = {}
    with RawConn(socket, timeout_s=30) as sub:
        sub.hello()
        eng = WireEngine(sub, LAYOUT, 64, model="tenant-b")
        reply = sub.call("subscribe")
        events["subscribe"] = error_code(reply) or "served"
        send(out, {"phase": "subscribed", "rpc": rpc, "subscribe": events["subscribe"]})
        inbox.recv(120)  # A stored a conversation meanwhile
        if "result" in reply:
            eng.insert(conversation(4242, np.random.default_rng(4242)))
            b_salt = eng.salt.hex()
            a_hits, mine = 0, False
            while not mine:
                if not sub.events:
                    sub.events.append(sub.recv(timeout_s=30, skip_events=False).get("event"))
                ev = sub.events.pop(0)
                if not isinstance(ev, dict):
                    continue
                if ev.get("namespace") == a["salt"] or set(map(bytes.hex, ev.get("keys", []))) & set(a["keys"]):
                    a_hits += 1
                mine = ev.get("namespace") == b_salt
            events["events about A"] = a_hits
    send(out, {"phase": "events", "events": events})

    # 4. after A took the host memory back over: does any old mapping show A's new pages?
    msg = inbox.recv(300)
    refill = {bytes.fromhex(h) for h in msg["needles"]}
    stale = len(set().union(*(found_needles(m, refill) for _, _, m in maps)))
    for _, _, m in maps:
        m.close()
    send(out, {"phase": "refilled", "a_pages_readable_via_old_mappings": stale, "truncated": truncate(fds)})
    cache.close()
