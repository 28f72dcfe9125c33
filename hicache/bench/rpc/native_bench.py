"""`hicache bench native`: each native path against its Python fallback, in one run. The
figures `hicache doctor` quotes for a path that runs in Python come from this bench: its
`--json` output is committed as hicache/data/native_costs.json (docs/benchmarks.md has the
rows and how they were measured).

Every row's value is the Python path, its baseline the native one (ratio = Python / native),
rounds of the two taking turns:

- index, match + release: RadixIndex.match_locked + unlock_held of a 16K-token prompt (1024
  pages of 16 tokens over 8 nodes, one engine's device) in an index of `index_pages` pages,
  with the C loops and in Python on the same index; p50 of single operations;
- frame_loop, match + release and a 16K-token insert (a frame of ~84 KB: keys, tokens, page
  ids): round trips from one client to a daemon on the native frame loop and to one on
  asyncio (HICACHE_NATIVE_RPC=0), the index in C in both; p50;
- disk_writer, put of 64 KiB pages: batches of put_many_async (as the daemon's write-through)
  into a fresh disk tier, the C put loop against DiskTierConfig(native_writer=False); wall
  time per page of a round, median round;
- copy, page copy: pages of `LAYOUT` (32 layers, K and V: 64 chunks of 32 KiB each) copied by
  ChunkCopier with the native batch copy and with one ctypes memmove per chunk; p50 per page.

A path whose native module is not loaded here gets NaN and a note saying why.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from hicache.bench.report import row
from hicache.bench.rpc.rpc_bench import LAYOUT
from hicache.layout import KVLayout

SEQ_PAGES = 1024  # a 16K-token prompt at page size 16
TURNS = 8  # nodes on its path: one per turn of the conversation that built it
DISK_PAGE_BYTES = 64 << 10
COPY_PAGES = 16  # pages per timed copy
# The round trips' engine: the frames are the same whatever the page bytes (keys and tokens),
# and small pages keep the two daemons' arenas small.
RPC_LAYOUT = KVLayout("mha", num_layers=2, page_size=LAYOUT.page_size, dtype="float16", num_kv_heads=1, head_dim=8)


def _p50_us(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e6


def _rounds(repeats: int, timers: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each timer once per round, the order alternating; the median round's figure (seconds)."""
    out: dict[str, list[float]] = {k: [] for k in timers}
    names = list(timers)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(timers[name]())
    return {k: float(np.median(v)) for k, v in out.items()}


def _unavailable(path: str, op: str, unit: str, why: str | None) -> dict:
    return row(f"{path}: {op} p50", float("nan"), unit, path=path, op=op, note=f"native unavailable: {why}")


def _path_row(path: str, op: str, python_s: float, native_s: float, what: str = "p50") -> dict:
    return row(f"{path}: {op} {what}", python_s * 1e6, "us", native_s * 1e6, "native", path=path, op=op)


# -- index ------------------------------------------------------------------------------
def index_rows(index_pages: int, ops: int, repeats: int) -> list[dict]:
    from hicache.index import native_index
    from hicache.index.keys import PackedKeys, page_keys
    from hicache.index.radix import RadixIndex

    mod = native_index.load()
    if mod is None:
        return [_unavailable("index", "match + release", "us", native_index.unavailable_reason())]
    ps = LAYOUT.page_size
    index = RadixIndex(ps, b"native-bench-slt")
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1 << 30, 64 * ps, dtype=np.int32)  # a system prompt every conversation shares
    next_page = 0
    target = None
    for c in range(max(1, index_pages // SEQ_PAGES)):
        tokens = np.concatenate([system, rng.integers(0, 1 << 30, (SEQ_PAGES - 64) * ps, dtype=np.int32)])
        keys = page_keys(index.salt, tokens, ps)
        for t in range(1, TURNS + 1):  # turn by turn, as a conversation grows: a node per turn
            n = SEQ_PAGES * t // TURNS
            index.insert(keys[:n], tokens[:n * ps], engine=0,
                         device_pages=np.arange(next_page, next_page + n, dtype=np.int64))
            next_page += n
        if c == 0:
            target = PackedKeys(b"".join(keys))
    assert target is not None

    def timer(native: bool) -> Callable[[], float]:
        def run() -> float:
            index.use_native(mod if native else None)
            samples = []
            for _ in range(ops):
                t0 = time.perf_counter()
                path, _, _, device_pages, _, locks = index.match_locked(target, 0)
                index.unlock_held(locks)
                samples.append(time.perf_counter() - t0)
            if len(device_pages) != SEQ_PAGES or len(path) < TURNS:
                raise RuntimeError(f"the bench's match found {len(device_pages)} pages on a path of {len(path)}")
            return float(np.median(samples))
        return run

    try:
        t = _rounds(repeats, {"native": timer(True), "python": timer(False)})
    finally:
        index.use_native(mod)
    return [_path_row("index", "match + release", t["python"], t["native"])]


# -- frame loop ---------------------------------------------------------------------------
def frame_loop_rows(requests: int, repeats: int) -> list[dict]:
    from hicache.client.connection import RpcConnection
    from hicache.daemon.serve.launcher import LocalDaemon
    from hicache.index.keys import page_keys
    from hicache.rpc import native_conn
    from hicache.rpc.framing import BlobRequest, ids_to_bytes

    if native_conn.load() is None:
        why = native_conn.unavailable_reason()
        return [_unavailable("frame_loop", op, "us", why) for op in ("match + release", "16K-token insert")]
    work = tempfile.mkdtemp(prefix="hicache-native-bench-")
    daemons, conns = {}, {}
    try:
        for mode, flag in (("native", "1"), ("python", "0")):
            d = LocalDaemon(os.path.join(work, mode), "--host-capacity", "64MiB", "--no-disk",
                            env={"HICACHE_NATIVE_RPC": flag})
            daemons[mode] = d.start()
            conns[mode] = RpcConnection.connect(d.socket, timeout_s=30)
        tokens = np.random.default_rng(1).integers(0, 1 << 30, SEQ_PAGES * LAYOUT.page_size, dtype=np.int32)
        calls: dict[str, dict[str, Callable[[], None]]] = {}
        for mode, conn in conns.items():
            conn.hello()
            if conn.call("stats")["rpc"]["frame_loop"] != ("native" if mode == "native" else "asyncio"):
                raise RuntimeError(f"the {mode} daemon did not start on that frame loop")
            reg = conn.call("register", {"model": "bench", "layout": RPC_LAYOUT.to_dict(), "device_pages": 4096})
            engine = reg["engine"]
            keys = b"".join(page_keys(reg["salt"], tokens, RPC_LAYOUT.page_size))
            insert = {"engine": engine, "keys": keys, "tokens": tokens.tobytes(),
                      "device_pages": ids_to_bytes(np.arange(1, SEQ_PAGES + 1))}
            r = conn.call("insert", insert)
            if r["backup"]:
                conn.call("backup_done", {"backup": r["backup"]["id"]})
            match = BlobRequest("match", {"engine": engine}, "keys")  # as HiCacheClient.match sends it

            def match_release(conn: RpcConnection = conn, match: BlobRequest = match, keys: bytes = keys) -> None:
                conn.call("release", {"pin": conn.call_blob(match, keys)["pin"]})

            def insert_again(conn: RpcConnection = conn, insert: dict = insert) -> None:
                conn.call("insert", insert)
            calls[mode] = {"match + release": match_release, "16K-token insert": insert_again}

        def timer(mode: str, op: str) -> Callable[[], float]:
            fn = calls[mode][op]

            def run() -> float:
                samples = []
                for i in range(requests + 20):
                    t0 = time.perf_counter()
                    fn()
                    if i >= 20:  # the first ones warm the connection
                        samples.append(time.perf_counter() - t0)
                return float(np.median(samples))
            return run

        rows = []
        for op in ("match + release", "16K-token insert"):
            t = _rounds(repeats, {"native": timer("native", op), "python": timer("python", op)})
            rows.append(_path_row("frame_loop", op, t["python"], t["native"]))
        return rows
    finally:
        for conn in conns.values():
            conn.close()
        for d in daemons.values():
            d.stop()
        shutil.rmtree(work, ignore_errors=True)


# -- disk writer ----------------------------------------------------------------------------
def disk_rows(pages: int, repeats: int) -> list[dict]:
    from hicache.bench.tiers.disk_bench import _make_pages, _tier_put
    from hicache.tiers.disk import native as disk_native
    from hicache.tiers.disk.tier import DiskTier, DiskTierConfig

    if disk_native.LIBRARY.load() is None:
        return [_unavailable("disk_writer", "put of 64 KiB pages", "us", disk_native.LIBRARY.unavailable_reason())]
    work = tempfile.mkdtemp(prefix="hicache-native-bench-disk-")
    sources = _make_pages(DISK_PAGE_BYTES)
    salt = os.urandom(16)

    def timer(native: bool) -> Callable[[], float]:
        def run() -> float:
            path = os.path.join(work, "tier")
            shutil.rmtree(path, ignore_errors=True)
            tier = DiskTier.open(path, pages * DISK_PAGE_BYTES * 2, config=DiskTierConfig(native_writer=native))
            try:
                if native and (not disk_native.tried() or disk_native.unavailable_reason()):  # not for this py-lmdb
                    raise RuntimeError(f"the native disk writer is unusable here: {disk_native.unavailable_reason()}")
                keys = [os.urandom(16) for _ in range(pages)]
                wall_gbps, _ = _tier_put(tier, salt, DISK_PAGE_BYTES, keys, sources)
            finally:
                tier.close()
            return DISK_PAGE_BYTES / (wall_gbps * 1e9)
        return run

    try:
        t = _rounds(repeats, {"native": timer(True), "python": timer(False)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [_path_row("disk_writer", "put of 64 KiB pages", t["python"], t["native"], "per page")]


# -- copy ------------------------------------------------------------------------------------
def copy_rows(ops: int, repeats: int) -> list[dict]:
    from hicache.kernels import copy as kcopy
    from hicache.kernels import native_copy

    if native_copy.chunk_copy() is None:
        return [_unavailable("copy", "page copy", "us", native_copy.unavailable_reason())]
    chunk = LAYOUT.page_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2  # one layer's K (or V) of a page, bf16
    chunks = 2 * LAYOUT.num_layers * COPY_PAGES
    src = np.random.default_rng(2).integers(0, 256, chunks * chunk, dtype=np.uint8)
    dst = np.zeros_like(src)
    # a layer-first source into page-first destinations: chunk i of page p goes to p's own run
    order = np.random.default_rng(3).permutation(chunks)
    src_ptrs = src.ctypes.data + order.astype(np.int64) * chunk
    dst_ptrs = dst.ctypes.data + np.arange(chunks, dtype=np.int64) * chunk
    sizes = np.full(chunks, chunk, dtype=np.int64)
    copiers = {"native": kcopy.ChunkCopier(1), "python": kcopy.ChunkCopier(1, native=False)}

    def timer(mode: str) -> Callable[[], float]:
        def run() -> float:
            copier = copiers[mode]
            samples = []
            for _ in range(ops):
                t0 = time.perf_counter()
                copier.copy(src_ptrs, dst_ptrs, sizes)
                samples.append((time.perf_counter() - t0) / COPY_PAGES)
            return float(np.median(samples))
        return run

    try:
        if not copiers["native"].is_native:
            raise RuntimeError("the native copier did not load the batch copy")
        t = _rounds(repeats, {"native": timer("native"), "python": timer("python")})
        if not np.array_equal(dst[:chunk], src[order[0] * chunk:(order[0] + 1) * chunk]):
            raise RuntimeError("the bench's copy moved the wrong bytes")
    finally:
        for c in copiers.values():
            c.close()
    return [_path_row("copy", f"page copy ({2 * LAYOUT.num_layers} chunks of {chunk >> 10} KiB)",
                      t["python"], t["native"])]


PATHS = ("index", "frame_loop", "disk_writer", "copy")


def run(paths: tuple[str, ...] = PATHS, index_pages: int = 1 << 20, requests: int = 2000, disk_pages: int = 512,
        repeats: int = 5) -> list[dict]:
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown native paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    rows: list[dict] = []
    if "index" in paths:
        rows += index_rows(index_pages, requests, repeats)
    if "frame_loop" in paths:
        rows += frame_loop_rows(requests, repeats)
    if "disk_writer" in paths:
        rows += disk_rows(disk_pages, repeats)
    if "copy" in paths:
        rows += copy_rows(max(10, requests // 50), repeats)
    return rows
