"""`hicache bench remote`: the remote tier's put / get throughput and lookup latency
against plain redis-py on the same store, in one run.

The tier's side runs the daemon's own code path: records built and verified
(tiers/remote/record.py: header, tokens, copy + checksum), RedisStore pipelines (one MGET
per run of 16 pages, hash-tagged keys) on the RemoteWorker's thread, the result
awaited from a second event loop as the daemon's loop does. The baseline is what
an integration without the tier would do: redis-py asyncio on the caller's loop,
pipelined SET / GET of the same page bytes under plain keys (no header, no
checksum, no copy into a destination), the same batch size. Lookup latency: the
daemon's galloping probe of a 512-page continuation (10 EXISTS) through the
worker, vs the same EXISTS pipelined by redis-py on the caller's loop. Signed
put / get: the tier's path with records signed and verified under a cluster
secret (tiers/remote/auth.py: HMAC-SHA256 over each record), against the unsigned tier.

By default a 3-master Redis Cluster is started on loopback ports (redis-server
must be installed); `--url` measures an existing store instead (its keys under
`hc1:` and `hicache-bench:` are written and deleted).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.report import row
from hicache.index.keys import page_keys
from hicache.tiers.remote import record as rr
from hicache.tiers.remote.auth import RecordAuth
from hicache.tiers.remote.redis_store import RedisStore
from hicache.tiers.remote.store import addresses
from hicache.tiers.remote.worker import RemoteWorker

SALT = bytes(range(16))
FINGERPRINT = bytes(16)
PAGE_SIZE = 16  # tokens per page
BATCH = 64  # pages per pipeline, both sides


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def _raw_client(url: str, cluster: bool) -> Any:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    if cluster:
        client = RedisCluster.from_url(url)
        await client.initialize()
        return client
    return aioredis.Redis.from_url(url)


async def _bench_size(url: str, page_bytes: int, total_bytes: int, repeats: int, rows: list[dict]) -> None:
    n = max(BATCH, total_bytes // page_bytes // BATCH * BATCH)
    toks = np.random.default_rng(1).integers(0, 50000, n * PAGE_SIZE, dtype=np.int32)
    keys = page_keys(SALT, toks, PAGE_SIZE)
    pages = np.random.default_rng(2).integers(0, 256, (n, page_bytes), dtype=np.uint8)
    addrs = addresses(SALT, keys, 0, n)
    store = RedisStore(url, timeout_s=30.0)
    worker = RemoteWorker(store, timeout_s=30.0)
    while not worker.available:  # the worker connects in the background
        if worker.last_error and worker.state == "connecting":
            worker.close()
            raise SystemExit(f"bench remote: cannot reach the store: {worker.last_error}")
        await asyncio.sleep(0.01)
    raw = await _raw_client(url, store.cluster)
    raw_keys = [b"hicache-bench:%d" % i for i in range(n)]
    outs = np.zeros_like(pages)
    gb = n * page_bytes / 1e9

    buffers = rr.BufferPool()  # as RemoteMover keeps one
    signer = RecordAuth([b"hicache-bench-secret-0123456789abcdef"])

    async def tier_put(auth: RecordAuth | None = None) -> None:
        async def job(lo: int) -> None:
            recs = await worker.run_cpu(lambda: [(addrs[i], rr.encode(SALT, keys[i], keys[i - 1] if i else None,
                                                                      FINGERPRINT, toks[i * PAGE_SIZE:(i + 1) * PAGE_SIZE],
                                                                      pages[i], pool=buffers, auth=auth))
                                                 for i in range(lo, lo + BATCH)])
            assert await store.put(recs, 3600) == BATCH
            buffers.give([r for _, r in recs])
        await asyncio.gather(*(asyncio.wrap_future(worker.submit(job(lo))) for lo in range(0, n, BATCH)))

    async def tier_get(auth: RecordAuth | None = None) -> None:
        async def job(lo: int) -> int:
            blobs = await store.get(addrs[lo:lo + BATCH])

            def verify() -> int:
                for i in range(lo, lo + BATCH):
                    rr.decode_into(blobs[i - lo], salt=SALT, key=keys[i], parent=keys[i - 1] if i else None,
                                   fingerprint=FINGERPRINT, page_size=PAGE_SIZE, out=outs[i], auth=auth)
                return BATCH
            return await worker.run_cpu(verify)
        done = await asyncio.gather(*(asyncio.wrap_future(worker.submit(job(lo))) for lo in range(0, n, BATCH)))
        assert sum(done) == n

    async def raw_put() -> None:
        async def job(lo: int) -> None:
            async with raw.pipeline(transaction=False) as pipe:
                for i in range(lo, lo + BATCH):
                    pipe.set(raw_keys[i], pages[i].data, ex=3600)
                await pipe.execute()
        await asyncio.gather(*(job(lo) for lo in range(0, n, BATCH)))

    async def raw_get() -> None:
        async def job(lo: int) -> None:
            async with raw.pipeline(transaction=False) as pipe:
                for i in range(lo, lo + BATCH):
                    pipe.get(raw_keys[i])
                got = await pipe.execute()
            assert len(got[0]) == page_bytes
        await asyncio.gather(*(job(lo) for lo in range(0, n, BATCH)))

    async def signed_put() -> None:
        await tier_put(signer)

    async def signed_get() -> None:
        await tier_get(signer)

    steps = (("raw_put", raw_put), ("tier_put", tier_put), ("raw_get", raw_get), ("tier_get", tier_get),
             ("signed_put", signed_put), ("signed_get", signed_get))  # signed_get reads signed_put's records
    times: dict[str, list[float]] = {name: [] for name, _ in steps}
    for _ in range(repeats):  # interleaved, so drift in the machine's load hits both sides alike
        for name, fn in steps:
            t0 = time.perf_counter()
            await fn()
            times[name].append(time.perf_counter() - t0)
    assert np.array_equal(outs, pages), "pages came back changed"
    kib = page_bytes >> 10
    rows.append(row(f"put {kib} KiB pages", gb / _median(times["tier_put"]), "GB/s",
                    gb / _median(times["raw_put"]), "redis-py SET"))
    rows.append(row(f"get {kib} KiB pages (verified)", gb / _median(times["tier_get"]), "GB/s",
                    gb / _median(times["raw_get"]), "redis-py GET"))
    rows.append(row(f"put {kib} KiB pages, signed", gb / _median(times["signed_put"]), "GB/s",
                    gb / _median(times["tier_put"]), "unsigned tier put"))
    rows.append(row(f"get {kib} KiB pages, MAC verified", gb / _median(times["signed_get"]), "GB/s",
                    gb / _median(times["tier_get"]), "unsigned tier get"))

    # lookup: the galloping probe of a 512-page continuation
    probe_n = min(512, n)
    offsets = sorted({(1 << j) - 1 for j in range(probe_n.bit_length()) if (1 << j) - 1 < probe_n} | {probe_n - 1})
    probe = [addrs[o] for o in offsets]
    from hicache.tiers.remote.redis_store import record_key
    probe_keys = [record_key(a) for a in probe]
    tier_lat, raw_lat = [], []
    for _ in range(200 * repeats):
        t0 = time.perf_counter()
        found = await asyncio.wrap_future(worker.submit(store.exists(probe)))
        tier_lat.append(time.perf_counter() - t0)
        assert all(found)
        t0 = time.perf_counter()
        async with raw.pipeline(transaction=False) as pipe:
            for k in probe_keys:
                pipe.exists(k)
            await pipe.execute()
        raw_lat.append(time.perf_counter() - t0)
    for q, name in ((50, "p50"), (99, "p99")):
        t, r = np.percentile(tier_lat, q) * 1e6, np.percentile(raw_lat, q) * 1e6
        rows.append(row(f"lookup {len(probe)} EXISTS {name} ({kib} KiB run)", t, "us", r, "redis-py pipeline"))

    await asyncio.wrap_future(worker.submit(store.delete_namespace(SALT)))
    for lo in range(0, n, 512):
        await raw.delete(*raw_keys[lo:lo + 512])  # split by slot on a cluster
    await raw.aclose()
    worker.close()


def run(url: str | None, page_kib: tuple[int, ...], total_mib: int, repeats: int) -> list[dict]:
    local = None
    if url is None:
        from hicache.bench.procs.redis_procs import LocalRedis

        local = LocalRedis(Path(tempfile.mkdtemp(prefix="hicache-bench-redis-")), masters=3)
        local.start()
        url = local.url
    rows: list[dict] = []
    try:
        for kib in page_kib:
            asyncio.run(_bench_size(url, kib << 10, total_mib << 20, repeats, rows))
    finally:
        if local is not None:
            local.stop()
    return rows
