"""The native frame loop's fast path (hicache/rpc/native_fast_parse.c) answers exactly
as the Python path does: one random sequence of match / release / insert frames, well-formed
and not, goes to a daemon on each frame loop, and every answer must be the same bytes and
the daemons' state the same afterwards."""

from __future__ import annotations

import os
import random
import socket
import struct

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.index.keys import page_keys
from hicache.rpc import native_conn
from hicache.rpc.framing import BlobRequest, ids_to_bytes, pack_frame
from hicache.rpc.protocol import PROTOCOL_VERSION
from tests.daemon.disk_faults_util import free_port, metrics_text
from tests.rpc.wire import LAYOUT, raw, recv_raw

needs_native = pytest.mark.skipif(native_conn.load() is None and os.environ.get("CI") != "true",
                                  reason=f"native frame loop {native_conn.unavailable_reason()}")
MAX_PAGES = 20000  # the daemons' max_request_pages: a longer match is refused
PAGES = 64  # most requests' longest
BIG = 16400  # one sequence whose page ids take a bin32 (over 64 KiB)
SYNC_ID = 1 << 40  # never used by the sequence


def body(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def exchange(s: socket.socket, frames: list[bytes], sync_id: int) -> list[bytes]:
    """Send frames, then a sync: every answer up to the sync's, as raw bodies."""
    s.sendall(b"".join(frames) + pack_frame({"id": sync_id, "method": "sync", "params": {}}))
    out = []
    while True:
        b = recv_raw(s)
        out.append(b)
        if msgpack.unpackb(b).get("id") == sync_id:
            return out


def sequence(seed: int, n: int) -> list[list]:
    """Steps of the scenario, each a list of ops a daemon's run turns into frames (pins
    and engines are the ids the run saw, so both daemons get the same frames)."""
    rng = random.Random(seed)
    steps: list[list] = [[("match", 0, 2, 1, "ok")], [("release", 0, 0.0, "ok")]]  # before hello
    steps.append([("hello",)])
    steps.append([("register", "a"), ("register", "b")])
    steps += [[("insert", 0, 7, BIG)], [("match", 0, 7, BIG, "ok")], [("match", 0, 7, 1200, "ok")]]
    for i in range(n):
        kind = rng.choice(["match", "match", "match", "release", "release", "insert", "batch"])
        if kind == "batch":  # several in one write: one turn of the frame loop
            steps.append([op_of(rng, rng.choice(["match", "release", "insert"])) for _ in range(rng.randint(2, 6))])
        else:
            steps.append([op_of(rng, kind)])
    return steps


def op_of(rng: random.Random, kind: str) -> tuple:
    if kind == "insert":
        return ("insert", rng.randrange(2), rng.randrange(4), rng.randint(1, PAGES))
    if kind == "release":
        how = rng.choice(["ok", "ok", "quiet", "quiet", "unknown", "unknown_quiet", "twice", "str", "extra",
                          "negative", "other_engine"])
        return ("release", rng.randrange(2), rng.random(), how)
    how = rng.choice(["ok", "ok", "ok", "quiet", "quiet_false", "wrong_engine", "negative_engine", "odd_keys",
                      "oversized", "extra", "params_first", "map16", "trailing", "dup_id", "bool_engine",
                      "empty", "float_id", "unknown_method_shape"])
    return ("match", rng.randrange(2), rng.randrange(4), rng.randint(0, PAGES), how)


class Run:
    """One daemon's side of the scenario: its socket, the ids it was given."""

    def __init__(self, path: str) -> None:
        self.s = raw(path)
        self.engines: list[int] = []
        self.salts: list[bytes] = []
        self.pins: list[int] = []
        self.next_id = 1

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def keys(self, e: int, prefix: int, n_pages: int) -> tuple[bytes, np.ndarray]:
        tokens = (np.arange(n_pages * LAYOUT.page_size, dtype=np.int32) + 1000 * prefix)
        salt = self.salts[e] if self.salts else bytes(16)  # before register: any keys
        return b"".join(page_keys(salt, tokens, LAYOUT.page_size)), tokens

    def frames(self, op: tuple) -> list[bytes]:
        if op[0] == "hello":
            return [pack_frame({"id": self.rid(), "method": "hello", "params": {"version": PROTOCOL_VERSION}})]
        if op[0] == "register":
            return [pack_frame({"id": self.rid(), "method": "register", "params": {
                "model": op[1], "layout": LAYOUT.to_dict(), "device_pages": 1 << 15}})]
        if op[0] == "insert":
            _, e, prefix, n = op
            keys, tokens = self.keys(e, prefix, n)
            return [pack_frame({"id": self.rid(), "method": "insert", "params": {
                "engine": self.engines[e], "keys": keys, "tokens": tokens.tobytes(),
                "device_pages": ids_to_bytes(np.arange(1, n + 1) + 16 * prefix)}})]
        if op[0] == "release":
            _, e, pick, how = op
            pin = self.pins[int(pick * len(self.pins))] if self.pins else 1
            if how == "unknown" or how == "unknown_quiet":
                pin = 10 ** 9
            if how == "negative":
                pin = -1
            msg = {"id": self.rid(), "method": "release", "params": {"pin": pin if how != "str" else str(pin)}}
            if how in ("quiet", "unknown_quiet"):
                msg["noreply"] = True
            if how == "extra":
                msg["params"]["x"] = 1
            frames = [pack_frame(msg)]
            if how == "twice":
                frames.append(pack_frame({**msg, "id": self.rid()}))
            return frames
        _, e, prefix, n, how = op
        keys, _ = self.keys(e, prefix, n)
        engine = self.engines[e] if self.engines else 1
        rid = self.rid()
        if how == "ok":
            return [BlobRequest("match", {"engine": engine}, "keys").frame(rid, keys)]
        params: dict = {"engine": engine, "keys": keys}
        msg: dict = {"id": rid, "method": "match", "params": params}
        if how == "quiet":
            msg["noreply"] = True
        elif how == "quiet_false":
            msg["noreply"] = False
        elif how == "wrong_engine":
            params["engine"] = 999
        elif how == "negative_engine":
            params["engine"] = -3
        elif how == "bool_engine":
            params["engine"] = True
        elif how == "odd_keys":
            params["keys"] = keys + b"x"
        elif how == "oversized":
            params["keys"] = self.keys(e, prefix, MAX_PAGES + 1)[0]
        elif how == "extra":
            params["extra"] = 0
        elif how == "empty":
            params["keys"] = b""
        elif how == "float_id":
            msg["id"] = 1.0
        elif how == "unknown_method_shape":
            msg["method"] = "matc"
        elif how == "params_first":
            msg = {"params": params, "noreply": False, "method": "match", "id": rid}
        elif how == "map16":  # the same map with a map16 header: valid msgpack, not the client's shape
            b = msgpack.packb(msg, use_bin_type=True)
            return [body(b"\xde\x00\x03" + b[1:])]
        elif how == "trailing":
            return [body(msgpack.packb(msg, use_bin_type=True) + b"\x00")]
        elif how == "dup_id":
            b = msgpack.packb(msg, use_bin_type=True)
            return [body(b"\x84\xa2id\x05" + b[1:])]
        return [pack_frame(msg)]

    def step(self, ops: list, sync_id: int) -> list[bytes]:
        frames = [f for op in ops for f in self.frames(op)]
        out = exchange(self.s, frames, sync_id)
        for b in out:
            r = msgpack.unpackb(b).get("result")
            if isinstance(r, dict) and "pin" in r:
                self.pins.append(r["pin"])
            if isinstance(r, dict) and "salt" in r:
                self.engines.append(r["engine"])
                self.salts.append(r["salt"])
        return out


def rpc_metrics(port: int) -> dict:
    """Request counts by (method, code) and latency observations by method, from /metrics."""
    text = metrics_text(port)
    return {(s.labels.get("method"), s.labels.get("code"), s.name): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("hicache_requests_total", "hicache_rpc_latency_seconds_count")}


def ask(path: str, method: str, params: dict) -> dict:
    s = raw(path)
    try:
        s.sendall(pack_frame({"id": 1, "method": "hello", "params": {"version": PROTOCOL_VERSION}}))
        recv_raw(s)
        s.sendall(pack_frame({"id": 2, "method": method, "params": params}))
        return msgpack.unpackb(recv_raw(s))["result"]
    finally:
        s.close()


def stats_rpc(path: str) -> dict:
    return ask(path, "stats", {})["rpc"]


def state(path: str) -> dict:
    st, ls = ask(path, "stats", {}), ask(path, "ls", {"depth": 8})
    rpc = dict(st["rpc"])
    rpc.pop("frame_loop")
    rpc.pop("fast_requests")
    return {"pins": st["pins"], "requests": st["requests"], "tiers": st["tiers"], "rpc": rpc, "ls": ls}


@needs_native
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_match_and_release_answer_the_same_bytes_on_both_frame_loops(daemon_factory, seed):
    ports = [free_port(), free_port()]
    daemons = [daemon_factory("--host-capacity", "32MiB", "--no-disk", "--metrics-port", str(port),
                              env={"HICACHE_NATIVE_RPC": flag, "HICACHE_MAX_REQUEST_PAGES": str(MAX_PAGES)}).start()
               for flag, port in zip(("1", "0"), ports)]
    runs = [Run(d.socket) for d in daemons]
    for i, ops in enumerate(sequence(seed, 120)):
        native, asyncio_ = (run.step(ops, SYNC_ID + i) for run in runs)
        if ops[0][0] == "hello":  # its answer names the daemon's pid
            continue
        assert native == asyncio_, (i, ops, [msgpack.unpackb(b) for b in native],
                                    [msgpack.unpackb(b) for b in asyncio_])
    assert runs[0].pins == runs[1].pins and len(runs[0].pins) > 20
    for run in runs:
        run.s.close()
    native_state, asyncio_state = state(daemons[0].socket), state(daemons[1].socket)
    assert native_state == asyncio_state
    # the per-method metrics count the same answers (by result code) and latencies
    counts = [rpc_metrics(port) for port in ports]
    assert counts[0] == counts[1] and counts[0][("match", "OK", "hicache_requests_total")] > 30
    # the fast path did answer on the native loop (most frames are of the client's shape)
    rpc = [stats_rpc(d.socket) for d in daemons]
    assert rpc[0]["frame_loop"] == "native" and rpc[0]["fast_requests"] > 30
    assert rpc[1]["frame_loop"] == "asyncio" and rpc[1]["fast_requests"] == 0
