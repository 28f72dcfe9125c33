"""In-process engines for the fault-and-abuse suite: the real client (HiCacheClient +
EngineCache over a CPU DevicePool) storing and loading pages whose bytes are a pure
function of their key (tests/daemon/engine_worker.py), so any reader can check every
byte it is served against what the storing engine wrote."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from hicache.client.client import HiCacheClient
from hicache.client.engine_cache import EngineCache
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool

from tests.daemon.engine_worker import LAYOUTS, load, write_pages

LAYOUT = LAYOUTS["mha"]


def engine(socket: str, pool_pages: int = 512, model: str = "robust", extra_key: str = "",
           timeout_s: float = 5.0) -> EngineCache:
    pool = DevicePool(LAYOUT, num_slots=pool_pages * LAYOUT.page_size)
    alloc = PagedTokenToKVPoolAllocator(pool.num_slots, LAYOUT.page_size)
    client = HiCacheClient(LAYOUT, pool.num_pages, model=model, socket_path=socket, extra_key=extra_key,
                           timeout_s=timeout_s, backoff_s=(0.02, 0.2))
    return EngineCache(client, pool, alloc)


def store(cache: EngineCache, tokens: np.ndarray, timeout_s: float = 20.0) -> bool:
    """What an engine does with a request: look its prefix up, compute the rest (pages whose
    bytes derive from their keys), offer them to the cache, release, and report the backups
    (waiting for them up to `timeout_s`). False when the pool had no room for the rest
    (the daemon gone with the pool full of cached pages): the engine computes uncached."""
    prefix = cache.lookup(tokens)
    try:
        cache.finish_load(prefix)
        n_full = len(tokens) // cache.page_size
        new = cache.alloc_pages(n_full - prefix.num_pages)
        if new is None:
            return False
        write_pages(cache.pool, cache.client.page_keys(tokens)[prefix.num_pages:], new)
        cache.store(prefix, tokens, new)
    finally:
        cache.release(prefix)
    deadline = time.monotonic() + timeout_s
    while cache.backups and time.monotonic() < deadline:  # the copies run on the executor
        cache.poll()
        time.sleep(0.005)
    return True


def conversation(seed: int, rng: np.random.Generator) -> np.ndarray:
    """Tokens of one conversation; half of them share a prefix with others (the tree branches)."""
    n = int(rng.integers(10, 41)) * LAYOUT.page_size + int(rng.integers(0, LAYOUT.page_size))
    shared = int(rng.integers(1, 9)) * LAYOUT.page_size if rng.random() < 0.5 else 0
    head = np.random.default_rng(0).integers(0, 50000, shared, dtype=np.int32)
    tail = np.random.default_rng(seed).integers(0, 50000, n - shared, dtype=np.int32)
    return np.concatenate([head, tail]).astype(np.int32)


@dataclass
class Writers:
    """Engine threads storing conversations until stopped (or their daemon is gone)."""

    socket: str
    count: int
    seed: int
    pool_pages: int = 512  # small pools evict: under write-back that is what backs pages up
    stored: list[np.ndarray] = field(default_factory=list)  # every conversation offered (stored or not)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Writers:
        for w in range(self.count):
            t = threading.Thread(target=self._run, args=(w,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _run(self, w: int) -> None:
        rng = np.random.default_rng([self.seed, w])
        try:
            cache = engine(self.socket, pool_pages=self.pool_pages)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(f"writer {w} could not start: {type(e).__name__}: {e}")
            return
        try:
            i = 0
            while not self.stop.is_set():
                tokens = conversation(self.seed * 1_000_003 + w * 10_007 + i, rng)
                with self._lock:
                    self.stored.append(tokens)
                if not store(cache, tokens) or not cache.client.connected:
                    return  # the daemon is gone: this engine would only count misses now
                i += 1
        except Exception as e:  # noqa: BLE001 - an engine must never fail because the daemon died
            self.errors.append(f"writer {w}: {type(e).__name__}: {e}")
        finally:
            try:
                cache.close()
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"writer {w} close: {type(e).__name__}: {e}")

    def join(self, timeout_s: float = 60.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)
        alive = [t for t in self.threads if t.is_alive()]
        assert not alive, f"{len(alive)} writer engines still blocked {timeout_s:.0f}s after their daemon died"


def load_and_check(cache: EngineCache, tokens: np.ndarray) -> dict:
    """Look the conversation up and check every byte served: {loaded, bad_pages, ...}."""
    return load(cache, tokens)
