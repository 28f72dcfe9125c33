"""`hicache bench remote --backend mooncake`: the remote tier on Mooncake Store against
raw Mooncake calls on the same master, and against the tier on Redis, in one run.

- tier: the daemon's code path — records built and verified (tiers/remote/record.py), the
  MooncakeStore on the RemoteWorker's thread, its helper process moving them with
  zero-copy calls on the shared staging area (a copy in before a put, out after a get).
- raw: what an integration without the tier does — `batch_put_from` /
  `batch_get_into` of the page bytes straight from and into a registered buffer, on
  a client in this process (threads, the GIL released), no header, no checksum.
- redis: the same tier path on a local Redis (one redis-server: a node's share).
Both Mooncake sides write fresh keys each repeat (removed before it, untimed): a put
of a key Mooncake holds is a no-op, which would measure nothing. Lookup: the galloping
probe of a 512-page continuation through each tier. A local master and one storage
process are started on loopback ports (`--url` is for Redis only).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.report import row
from hicache.index.keys import page_keys
from hicache.tiers.remote import record as rr
from hicache.tiers.remote.store import RemoteStore, addresses, open_store
from hicache.tiers.remote.worker import RemoteWorker

SALT = bytes(range(16))
FINGERPRINT = bytes(16)
PAGE_SIZE = 16
BATCH = 64
RAW_THREADS = 4  # as the helper's transfer slots


class _Tier:
    """One backend behind the RemoteWorker, driven as the RemoteMover drives it."""

    def __init__(self, store: RemoteStore, keys: list[bytes], toks: np.ndarray, pages: np.ndarray) -> None:
        self.store, self.keys, self.toks, self.pages = store, keys, toks, pages
        self.addrs = addresses(SALT, keys, 0, len(keys))
        self.worker = RemoteWorker(store, timeout_s=60.0)
        self.buffers = rr.BufferPool()
        self.outs = np.zeros_like(pages)
        self.size = rr.record_bytes(PAGE_SIZE, pages.shape[1])

    async def up(self) -> None:
        deadline = time.monotonic() + 60
        while not self.worker.available:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench remote: cannot reach the store: {self.worker.last_error}")
            await asyncio.sleep(0.01)

    def _on(self, coro: Any) -> Any:
        return asyncio.wrap_future(self.worker.submit(coro))

    async def put(self) -> None:
        async def job(lo: int) -> None:
            recs = await self.worker.run_cpu(lambda: [
                (self.addrs[i], rr.encode(SALT, self.keys[i], self.keys[i - 1] if i else None, FINGERPRINT,
                                          self.toks[i * PAGE_SIZE:(i + 1) * PAGE_SIZE], self.pages[i],
                                          pool=self.buffers)) for i in range(lo, lo + BATCH)])
            assert await self.store.put(recs, 3600) == BATCH
            self.buffers.give([r for _, r in recs])
        await asyncio.gather(*(self._on(job(lo)) for lo in range(0, len(self.keys), BATCH)))

    async def get(self) -> None:
        async def job(lo: int) -> int:
            blobs = await self.store.get(self.addrs[lo:lo + BATCH], self.size)

            def verify() -> int:
                for i in range(lo, lo + BATCH):
                    rr.decode_into(blobs[i - lo], salt=SALT, key=self.keys[i],
                                   parent=self.keys[i - 1] if i else None, fingerprint=FINGERPRINT,
                                   page_size=PAGE_SIZE, out=self.outs[i])
                return BATCH
            return await self.worker.run_cpu(verify)
        assert sum(await asyncio.gather(*(self._on(job(lo)) for lo in range(0, len(self.keys), BATCH)))) == len(
            self.keys)

    async def clear(self) -> None:
        await self._on(self.store.delete_namespace(SALT))

    async def probe_us(self, rounds: int) -> list[float]:
        n = min(512, len(self.addrs))
        offsets = sorted({(1 << j) - 1 for j in range(n.bit_length()) if (1 << j) - 1 < n} | {n - 1})
        probe = [self.addrs[o] for o in offsets]
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            assert all(await self._on(self.store.exists(probe)))
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def close(self) -> None:
        self.worker.close()


class _Raw:
    """Plain Mooncake calls from and into a registered buffer on this process."""

    def __init__(self, local: Any, pages: np.ndarray) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", local.metadata_url, 0, 16 << 20, "tcp", "", local.master_address)
        if rc:
            raise SystemExit(f"bench remote: mooncake setup() returned {rc}")
        self.pages = pages
        self.outs = np.zeros_like(pages)
        self.page_bytes = pages.shape[1]
        for arr in (self.pages, self.outs):
            assert self.store.register_buffer(arr.ctypes.data, arr.nbytes) == 0
        self.keys = [f"hicache-bench:{i}" for i in range(len(pages))]
        self.config = ReplicateConfig()
        self.config.replica_num = 1

    def _ptrs(self, arr: np.ndarray, lo: int) -> list[int]:
        base = arr.ctypes.data
        return [base + i * self.page_bytes for i in range(lo, lo + BATCH)]

    async def put(self) -> None:
        def job(lo: int) -> None:
            codes = self.store.batch_put_from(self.keys[lo:lo + BATCH], self._ptrs(self.pages, lo),
                                              [self.page_bytes] * BATCH, self.config)
            assert all(c == 0 for c in codes), codes[:4]
        await _threaded(job, len(self.keys))

    async def get(self) -> None:
        def job(lo: int) -> None:
            codes = self.store.batch_get_into(self.keys[lo:lo + BATCH], self._ptrs(self.outs, lo),
                                              [self.page_bytes] * BATCH)
            assert all(c == self.page_bytes for c in codes), codes[:4]
        await _threaded(job, len(self.keys))

    async def clear(self) -> None:
        await asyncio.to_thread(self.store.batch_remove, self.keys, True)

    def close(self) -> None:
        self.store.close()


async def _threaded(job: Any, n: int) -> None:
    """job(lo) for every batch, RAW_THREADS batches at a time."""
    sem = asyncio.Semaphore(RAW_THREADS)

    async def one(lo: int) -> None:
        async with sem:
            await asyncio.to_thread(job, lo)
    await asyncio.gather(*(one(lo) for lo in range(0, n, BATCH)))


async def _bench_size(local: Any, redis_url: str, page_bytes: int, total_bytes: int, repeats: int,
                      rows: list[dict]) -> None:
    n = max(BATCH, total_bytes // page_bytes // BATCH * BATCH)
    toks = np.random.default_rng(1).integers(0, 50000, n * PAGE_SIZE, dtype=np.int32)
    keys = page_keys(SALT, toks, PAGE_SIZE)
    pages = np.random.default_rng(2).integers(0, 256, (n, page_bytes), dtype=np.uint8)
    staging_mib = max(64, 4 * BATCH * page_bytes * 2 >> 20)  # every transfer slot's batch, twice
    mc = _Tier(open_store(f"{local.url}&staging_mib={staging_mib}"), keys, toks, pages)
    rd = _Tier(open_store(redis_url, timeout_s=60.0), keys, toks, pages)
    raw = _Raw(local, pages)
    await mc.up()
    await rd.up()
    gb = n * page_bytes / 1e9
    steps = (("raw_put", raw.put, raw.clear), ("tier_put", mc.put, mc.clear), ("redis_put", rd.put, rd.clear),
             ("raw_get", raw.get, None), ("tier_get", mc.get, None), ("redis_get", rd.get, None))
    times: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    try:
        for _ in range(repeats):  # interleaved: drift in the machine's load hits every side alike
            for name, fn, before in steps:
                if before is not None:
                    await before()
                t0 = time.perf_counter()
                await fn()
                times[name].append(time.perf_counter() - t0)
        for got in (mc.outs, rd.outs, raw.outs):
            assert np.array_equal(got, pages), "pages came back changed"
        kib = page_bytes >> 10
        med = {k: gb / float(np.median(v)) for k, v in times.items()}
        rows.append(row(f"mooncake put {kib} KiB pages", med["tier_put"], "GB/s", med["raw_put"],
                        "raw batch_put_from"))
        rows.append(row(f"mooncake get {kib} KiB pages (verified)", med["tier_get"], "GB/s", med["raw_get"],
                        "raw batch_get_into"))
        rows.append(row(f"mooncake put {kib} KiB pages", med["tier_put"], "GB/s", med["redis_put"],
                        "redis tier put"))
        rows.append(row(f"mooncake get {kib} KiB pages (verified)", med["tier_get"], "GB/s", med["redis_get"],
                        "redis tier get"))
        mc_lat, rd_lat = await mc.probe_us(100 * repeats), await rd.probe_us(100 * repeats)
        for q in (50, 99):
            rows.append(row(f"mooncake lookup probe p{q} ({kib} KiB run)", float(np.percentile(mc_lat, q)), "us",
                            float(np.percentile(rd_lat, q)), "redis tier probe"))
        await mc.clear()
        await rd.clear()
        await raw.clear()
    finally:
        mc.close()
        rd.close()
        raw.close()


def run(redis_url: str | None, page_kib: tuple[int, ...], total_mib: int, repeats: int) -> list[dict]:
    from hicache.bench.procs.mooncake_procs import LocalMooncake, mooncake_missing
    from hicache.bench.procs.redis_procs import LocalRedis

    missing = mooncake_missing()
    if missing:
        raise SystemExit(f"bench remote --backend mooncake needs {missing}")
    root = Path(tempfile.mkdtemp(prefix="hicache-bench-mooncake-"))
    # room for the tier's records and the raw pages of one size at once, with headroom
    # below the store's 90% eviction mark
    local = LocalMooncake(root / "mooncake", storage=1, segment_mib=max(256, 3 * total_mib))
    redis = None
    rows: list[dict] = []
    try:
        local.start()
        if redis_url is None:
            redis = LocalRedis(root / "redis")
            redis.start()
            redis_url = redis.url
        for kib in page_kib:
            asyncio.run(_bench_size(local, redis_url, kib << 10, total_mib << 20, repeats, rows))
    finally:
        local.stop()
        if redis is not None:
            redis.stop()
    return rows

