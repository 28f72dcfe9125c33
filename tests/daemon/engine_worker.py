"""An engine process for daemon tests: stores or loads pages through a real daemon.

Page contents are a pure function of the page key and the layer, so a process
that loads a prefix can check every byte against what the storing one wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run as a script, this file's directory heads sys.path: put the checkout it belongs to
# before any installed hicache, so a worktree's tests drive that worktree's code.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache.client.client import HiCacheClient
from hicache.client.engine_cache import EngineCache
from hicache.layout import KVLayout
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool

LAYOUTS = {
    "mha": KVLayout("mha", num_layers=3, page_size=4, dtype="float16", num_kv_heads=2, head_dim=8),
    "mla": KVLayout("mla", num_layers=2, page_size=4, dtype="bfloat16", kv_lora_rank=16, qk_rope_head_dim=8),
}


def tokens_for(seed: int, n: int, shared: int = 0) -> np.ndarray:
    """n tokens whose first `shared` come from seed 0 (a common prefix)."""
    head = np.random.default_rng(0).integers(0, 50000, shared, dtype=np.int32)
    tail = np.random.default_rng(seed).integers(0, 50000, n - shared, dtype=np.int32)
    return np.concatenate([head, tail]).astype(np.int32)


def page_content(key: bytes, layer: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng([int.from_bytes(key[:8], "little"), layer])
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def write_pages(pool: DevicePool, keys: list[bytes], pages: np.ndarray) -> None:
    ps = pool.page_size
    for key, page in zip(keys, pages):
        rows = slice(int(page) * ps, int(page) * ps + ps)
        for layer in range(pool.layout.num_layers):
            k = pool.k_buffers[layer]
            k[rows] = page_content(key, 2 * layer, tuple(k[rows].shape), k.dtype)
            if pool.layout.has_v:
                v = pool.v_buffers[layer]
                v[rows] = page_content(key, 2 * layer + 1, tuple(v[rows].shape), v.dtype)


def check_pages(pool: DevicePool, keys: list[bytes], pages: np.ndarray) -> int:
    """Number of pages whose bytes differ from what the storing engine wrote."""
    bad = 0
    ps = pool.page_size
    for key, page in zip(keys, pages):
        rows = slice(int(page) * ps, int(page) * ps + ps)
        for layer in range(pool.layout.num_layers):
            bufs = [(pool.k_buffers[layer], 2 * layer)]
            if pool.layout.has_v:
                bufs.append((pool.v_buffers[layer], 2 * layer + 1))
            for buf, salt in bufs:
                want = page_content(key, salt, tuple(buf[rows].shape), buf.dtype)
                if not torch.equal(buf[rows].view(torch.uint8), want.view(torch.uint8)):
                    bad += 1
                    break
            else:
                continue
            break
    return bad


def make_cache(args) -> EngineCache:
    layout = LAYOUTS[args.layout]
    pool = DevicePool(layout, num_slots=args.pool_pages * layout.page_size)
    alloc = PagedTokenToKVPoolAllocator(pool.num_slots, layout.page_size)
    client = HiCacheClient(layout, pool.num_pages, model=args.model, socket_path=args.socket,
                           extra_key=args.extra_key, timeout_s=10.0, backoff_s=(0.02, 0.2))
    return EngineCache(client, pool, alloc)


def store(cache: EngineCache, tokens: np.ndarray) -> dict:
    prefix = cache.lookup(tokens)
    cache.finish_load(prefix)
    n_full = len(tokens) // cache.page_size
    new = cache.alloc_pages(n_full - prefix.num_pages)
    keys = cache.client.page_keys(tokens)
    write_pages(cache.pool, keys[prefix.num_pages:], new)
    cache.store(prefix, tokens, new)
    cache.release(prefix)
    deadline = time.monotonic() + 20
    while cache.backups and time.monotonic() < deadline:
        cache.poll()
        time.sleep(0.005)
    return {"device_len": int(prefix.match.device_len), "host_len": int(prefix.match.host_len),
            "stored_pages": int(n_full), "connected": cache.client.connected}


def load(cache: EngineCache, tokens: np.ndarray) -> dict:
    prefix = cache.lookup(tokens)
    for layer in range(cache.pool.layout.num_layers):
        prefix.wait_layer(layer)
    cache.finish_load(prefix)
    keys = cache.client.page_keys(tokens)
    bad = check_pages(cache.pool, keys[:prefix.num_pages], prefix.device_pages)
    out = {"device_len": int(prefix.match.device_len), "host_len": int(prefix.match.host_len),
           "disk_len": int(prefix.match.disk_len), "loaded": int(prefix.num_pages), "bad_pages": bad,
           "connected": cache.client.connected}
    cache.release(prefix)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--layout", default="mha")
    p.add_argument("--model", default="test-model")
    p.add_argument("--extra-key", default="")
    p.add_argument("--pool-pages", type=int, default=256)
    p.add_argument("--interactive", action="store_true", help="read commands from stdin, one JSON per line")
    p.add_argument("ops", nargs="*", help="store:SEED:N[:SHARED] or load:SEED:N[:SHARED]")
    args = p.parse_args()
    cache = make_cache(args)
    ops = args.ops if not args.interactive else (line.strip() for line in sys.stdin)
    for op in ops:
        if not op:
            continue
        kind, *nums = op.split(":")
        if kind == "quit":
            break
        seed, n, *rest = (int(x) for x in nums) if nums else (0, 0)
        tokens = tokens_for(seed, n, rest[0] if rest else 0)
        result = store(cache, tokens) if kind == "store" else load(cache, tokens)
        result["op"] = op
        print(json.dumps(result), flush=True)
    cache.close()


if __name__ == "__main__":
    main()
