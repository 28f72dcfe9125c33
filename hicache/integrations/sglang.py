"""hicache as SGLang's HiCache L3: a storage backend shared by every SGLang instance on the node.

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"hicache",
        "module_path":"hicache.integrations.sglang","class_name":"HiCacheStore","interface_v1":1}'

Extra-config keys read here: "socket" (the daemon's socket; default as for any
client), "namespace" (an extra salt: a LoRA, a model revision, a tenant),
"model" (the model's name in the namespace).

The model's name: "model" when given, else what SGLang passes, its served
model name (`--served-model-name`, which defaults to `--model-path`). A path
names a mount, not a model: the same weights at another path share nothing, so
give a name (either flag) where instances mount the model at different paths.
It is not guessed from the path (two models at `.../model` would share KV).

What SGLang's keys lack, the namespace adds. A key is a chained SHA-256 of
token ids only, so the namespace (hicache.index.keys.Namespace) names the model,
the TP rank and size (MLA: none, every rank shares one copy and only the
storage writer stores it), the pipeline / context-parallel shard, and the host
pool's geometry: layer count, heads, head dims, dtype, page size and its
memory layout, because a page is stored in the byte order of that layout.
Two instances agree on all of that exactly when they can use each other's bytes.

A page lives in the daemon under a key derived from SGLang's (see
hicache/daemon/ingest/keyed.py: the pages of a batch are a chain under the batch's
prefix, and the daemon finds any of them by key, since SGLang asks about keys in the
middle of a prefix). Its bytes are SGLang's "flat data page" for the
pool's layout (what `get_data_page(i, flat=True)` returns), so the tensor API
(`get`/`set`) and the zero-copy API (`batch_get_v1`/`batch_set_v1`, which copy
between the registered host pool and the daemon's arena with no staging)
read each other's pages.

Failure model: the daemon away, hung or refusing -> every call is a miss or
False within one call deadline, then at once while the client reconnects in
the background (hicache/client/client.py). A page whose disk copy fails its
checksum is a miss. Bad input (indices that are not whole pages, a page of
the wrong size) raises ValueError.

Connections: SGLang calls from several threads at once (prefetch, its IO
thread, backup) and replaces those threads on every `/flush_cache`
(HiCacheController.reset stops and restarts them; the backend is not told).
So connections are pooled, not per thread: a call takes a free connection and
gives it back, and a new one is opened only when every one is busy. Their
number is bounded by SGLang's concurrency, whatever the flushes, and a new
thread's first call does not pay a connect (the first is opened when the host
pool is registered).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache import hicache_storage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache.client.client import HiCacheClient
from hicache.client.deadlines import CallDeadlines
from hicache.client.keyed import KeyedPagesClient, named_page
from hicache.index.keys import Namespace
from hicache.kernels import copy as kcopy
from hicache.layout import DTYPE_ITEMSIZE, KVLayout

log = logging.getLogger(__name__)

# A hung daemon costs SGLang's prefetch / backup thread one deadline, then nothing until it
# answers again. fetch may wait for the disk tier, so it gets longer than the rest.
DEADLINES = CallDeadlines(connect_s=0.5, match_s=0.5, load_s=2.0, update_s=0.5, admin_s=5.0)

# The most pages SGLang hands one batch_set_v1 (its storage batch): the daemon keeps that much
# host room mapped and pre-faulted here ahead of each store, the first one included.
STORE_PAGES = int(getattr(hicache_storage, "STORAGE_BATCH_SIZE", 128))

# token axis (pools indexed by token slot) or page axis (indexed by page) of each host layout
_TOKEN_AXIS = {("mha", "layer_first"): 2, ("mha", "page_first"): 1, ("mla", "layer_first"): 1,
               ("mla", "page_first"): 0}
_PAGE_AXIS = {("mha", "page_first_direct"): 1, ("mha", "page_head"): 1, ("mla", "page_first_direct"): 0}


class PoolPages:
    """SGLang's host pool seen page by page: `pages[p]` is page p (a strided view) in the byte
    order of the pool's flat data page; the KVLayout names its geometry for the namespace."""

    def __init__(self, pool: Any) -> None:
        kind = "mla" if hasattr(pool, "kv_lora_rank") else "mha"
        layout_name = str(pool.layout)
        self.page_size = int(pool.page_size)
        dtype = str(pool.dtype).removeprefix("torch.")
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"hicache stores KV of dtypes {sorted(DTYPE_ITEMSIZE)}; this pool's is {dtype}")
        if kind == "mha":
            self.layout = KVLayout("mha", int(pool.layer_num), self.page_size, dtype, num_kv_heads=int(pool.head_num),
                                   head_dim=int(pool.head_dim), v_head_dim=int(pool.v_head_dim))
        else:
            if pool.kv_cache_dim != pool.kv_lora_rank + pool.qk_rope_head_dim:
                raise ValueError("MLA pools with an overridden row width (packed FP8 / indexer rows) are not "
                                 "supported")
            self.layout = KVLayout("mla", int(pool.layer_num), self.page_size, dtype,
                                   kv_lora_rank=int(pool.kv_lora_rank), qk_rope_head_dim=int(pool.qk_rope_head_dim))
        buf = pool.kv_buffer
        if (kind, layout_name) in _TOKEN_AXIS:
            axis = _TOKEN_AXIS[kind, layout_name]
            pages = buf.unflatten(axis, (-1, self.page_size)).movedim(axis, 0)
        elif (kind, layout_name) in _PAGE_AXIS:
            pages = buf.movedim(_PAGE_AXIS[kind, layout_name], 0)
        else:
            raise ValueError(f"host pool layout {layout_name!r} is not supported for {kind.upper()} "
                             f"(supported: {sorted(k[1] for k in (*_TOKEN_AXIS, *_PAGE_AXIS) if k[0] == kind)})")
        if pages[0].numel() * buf.element_size() != self.layout.page_bytes:
            raise ValueError(f"host pool page of {pages[0].numel() * buf.element_size()} bytes, expected "
                             f"{self.layout.page_bytes} for {self.layout}")
        self.kind, self.layout_name, self.pages, self.dtype = kind, layout_name, pages, buf.dtype
        # Pages move as lists of (address, address, bytes) chunks through one native call
        # (kcopy.ChunkCopier), not a torch copy_ per page: each copy_ of a page of MiBs
        # wakes torch's intra-op threads, and on a busy 2-core VM that ran at 0.1-0.2 of
        # one contiguous copy_ (hicache bench sglang).
        self._run_offsets, self._run_bytes = kcopy.strided_runs(pages[0])
        self._page_stride_bytes = pages.stride(0) * buf.element_size()
        self._copier = kcopy.ChunkCopier(torch.get_num_threads())

    def page_ids(self, keys: list[str], host_indices: torch.Tensor) -> np.ndarray:
        """The pool page of each key: `host_indices` must be whole pages, in key order."""
        ps, n = self.page_size, len(keys)
        idx = host_indices.detach().to("cpu", torch.int64).reshape(-1)
        if idx.numel() != n * ps:
            raise ValueError(f"{n} keys need {n * ps} host indices (page size {ps}), got {idx.numel()}")
        rows = idx.view(n, ps)
        first = rows[:, 0]
        if bool((first % ps != 0).any()) or not torch.equal(rows, first[:, None] + torch.arange(ps)):
            raise ValueError("host indices must be whole pages: page_size consecutive slots from a multiple of it")
        pages = (first // ps).numpy()
        if n and (pages.min() < 0 or pages.max() >= len(self.pages)):
            raise ValueError(f"host indices outside the pool's {len(self.pages)} pages")
        return pages

    def copy_with_arena(self, arena: Any, arena_ids: np.ndarray, pool_ids: np.ndarray, *, to_arena: bool) -> None:
        """Copy pool pages `pool_ids` to arena slots `arena_ids` (or back), in the flat data
        page's byte order. Both id lists are validated by the caller (page_ids, mapped)."""
        if len(pool_ids) == 0:
            return
        page_ptrs = self.pages.data_ptr() + np.asarray(pool_ids, dtype=np.int64) * self._page_stride_bytes
        slot_ptrs = arena.address + np.asarray(arena_ids, dtype=np.int64) * self.layout.page_bytes
        strided, flat, nbytes = kcopy.page_run_chunks(page_ptrs, self._run_offsets, self._run_bytes, slot_ptrs)
        if to_arena:
            self._copier.copy(strided, flat, nbytes)
        else:
            self._copier.copy(flat, strided, nbytes)

    def close(self) -> None:
        self._copier.close()

    def arena_pages(self, arena: Any) -> torch.Tensor:
        """The arena as slots shaped like our pages (only our namespace's slabs are mapped)."""
        pb = self.layout.page_bytes
        raw = torch.from_numpy(arena.array)
        return raw[:(raw.numel() // pb) * pb].view(-1, pb).view(self.dtype).view(-1, *self.pages.shape[1:])


def _load_sglang_key_hash() -> None:
    """Load SGLang's page-key hash (a C++ extension) now, during SGLang's start-up. Otherwise the
    first storage query of the process loads it (11 s measured here with the extension already
    built, minutes when it must build) on SGLang's prefetch thread, while the scheduler, not
    waiting for it, serves that first request with no hit."""
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
    except ImportError:  # another SGLang layout: its queries load whatever it uses
        return
    t0 = time.monotonic()
    get_hash_str([0], None, page_size=1)
    log.info("hicache: SGLang's page-key hash loaded in %.1fs", time.monotonic() - t0)


class HiCacheStore(HiCacheStorage):
    """SGLang HiCacheStorage over the hicache daemon. Built by SGLang's dynamic factory as
    `HiCacheStore(storage_config, kwargs)`; serves nothing until SGLang registers its host
    pool (`register_mem_pool_host`), whose geometry completes the namespace."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        model = extra.get("model") or storage_config.model_name
        if not model:
            raise ValueError("hicache needs the model's name for its namespace: SGLang's storage config has none; "
                             'pass "model" in --hicache-storage-backend-extra-config')
        c = storage_config
        self.config = c
        self.model = str(model)
        self.socket_path = extra.get("socket")
        self.writer = c.is_storage_writer  # MLA: one rank stores the copy every rank reads
        # MLA pages hold no heads, so every TP rank reads the same copy; MHA pages are the rank's heads.
        self.tp_rank, self.tp_size = (0, 1) if c.is_mla_model else (c.tp_rank, c.tp_size)
        self.shard = (f"pp={c.pp_rank}/{c.pp_size};cp={c.attn_cp_rank}/{c.attn_cp_size};"
                      f"dcp={c.dcp_rank}/{c.dcp_size}")
        self.user_namespace = str(extra.get("namespace", ""))
        dl = extra.get("deadlines")  # seconds, or per call kind (hicache/client/deadlines.py)
        self.deadlines = DEADLINES if dl is None else CallDeadlines.from_config(dl, base=DEADLINES)
        self.pool: PoolPages | None = None
        self._free: list[KeyedPagesClient] = []  # connections no call is using
        self._clients: list[HiCacheClient] = []  # every connection opened, for close()
        self._lock = threading.Lock()
        self._closed = False

    # -- setup ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = PoolPages(mem_pool_host)
        if pool.page_size < 4:
            raise ValueError(f"hicache needs --page-size >= 4 (a page's key travels in its token slots), "
                             f"got {pool.page_size}")
        self.pool = pool
        # a host pool with a page format of its own (SGLang's storage_format_tag) is another byte order
        tag = getattr(mem_pool_host, "storage_format_tag", None)
        extra_key = f"sglang;{pool.layout_name};{tag or ''};{self.shard};{self.user_namespace}"
        self.namespace = Namespace(self.model, pool.layout, self.tp_rank, self.tp_size, extra_key)
        self.salt = self.namespace.salt()
        log.info("hicache: SGLang namespace model %r, %s", self.model, pool.layout)
        kc = self._open()  # connect now, on SGLang's thread: a miss (and a background retry) if no daemon
        with self._lock:
            self._free.append(kc)
        _load_sglang_key_hash()

    def _open(self) -> KeyedPagesClient:
        ns = self.namespace
        client = HiCacheClient(ns.layout, 1, model=ns.model, socket_path=self.socket_path, tp_rank=ns.tp_rank,
                               tp_size=ns.tp_size, extra_key=ns.extra_key, deadlines=self.deadlines,
                               store_pages=STORE_PAGES if self.writer else 0)
        client.connect()
        with self._lock:
            self._clients.append(client)
        return KeyedPagesClient(client)

    @contextmanager
    def _keyed(self) -> Iterator[KeyedPagesClient | None]:
        """A connection for one call, used by no other call meanwhile; None after close()
        (misses, and no reconnect probe started again) or before the host pool is registered."""
        with self._lock:
            usable = not self._closed and self.pool is not None
            kc = self._free.pop() if usable and self._free else None
        if not usable:
            yield None
            return
        if kc is None:  # every connection is busy
            kc = self._open()
        try:
            yield kc
        finally:
            with self._lock:
                closed = self._closed
                if not closed:
                    self._free.append(kc)
            if closed:
                kc.client.close()

    def _page_keys(self, keys: list[str]) -> tuple[list[bytes], np.ndarray]:
        assert self.pool is not None
        named = [named_page(self.salt, k.encode(), self.pool.page_size) for k in keys]
        return [k for k, _ in named], (np.concatenate([t for _, t in named]) if named else np.empty(0, "<i4"))

    def _parent_key(self, extra_info: HiCacheStorageExtraInfo | None) -> bytes | None:
        """The page key before a batch: SGLang passes the prefix's keys (prefix_keys + keys is
        one chain), so the daemon hangs the batch under it."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if not prefix:
            return None
        assert self.pool is not None
        return named_page(self.salt, prefix[-1].encode(), self.pool.page_size)[0]

    # -- existence -------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys are stored (host or disk): one round trip."""
        with self._keyed() as kc:
            if kc is None or not keys:
                return 0
            return kc.exists(self._page_keys(keys)[0])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy: host pool <-> arena -------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy each stored page into its host-pool page; per key whether it was."""
        with self._keyed() as kc:
            return self._batch_get_v1(kc, keys, host_indices, extra_info)

    def _batch_get_v1(self, kc: KeyedPagesClient | None, keys: list[str], host_indices: torch.Tensor,
                      extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        pool = self.pool
        if kc is None or pool is None or not keys:
            return [False] * len(keys)
        pages = pool.page_ids(keys, host_indices)
        f = kc.fetch(self._page_keys(keys)[0])
        if f is None:
            return [False] * len(keys)
        try:
            if not kc.mapped(f.host_pages):
                return [False] * len(keys)
            hit = f.host_pages >= 0
            pool.copy_with_arena(kc.client.arena, f.host_pages[hit], pages[hit], to_arena=False)
            return (f.host_pages >= 0).tolist()
        finally:
            kc.release(f)  # after the copies: until then the daemon keeps the slots as they are

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy each host-pool page into the daemon's arena and publish it; per key whether
        it is stored now (already stored counts)."""
        with self._keyed() as kc:
            return self._batch_set_v1(kc, keys, host_indices, extra_info)

    def _batch_set_v1(self, kc: KeyedPagesClient | None, keys: list[str], host_indices: torch.Tensor,
                      extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        pool = self.pool
        if kc is None or pool is None or not keys:
            return [False] * len(keys)
        pages = pool.page_ids(keys, host_indices)
        if not self.writer:
            return [True] * len(keys)  # MLA: the storage writer's copy serves this rank too
        page_keys, tokens = self._page_keys(keys)
        r = kc.store(page_keys, tokens, self._parent_key(extra_info))
        if r is None:
            return [False] * len(keys)
        if not kc.mapped(r.host_pages):
            kc.store_done(r, ok=False)
            return [False] * len(keys)
        ok = False
        try:
            new = r.host_pages >= 0
            pool.copy_with_arena(kc.client.arena, r.host_pages[new], pages[new], to_arena=True)
            ok = True
        finally:
            done = kc.store_done(r, ok)
        return [done is not None] * len(keys)

    # -- tensor API: one flat page per key ------------------------------------------------------
    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        assert self.pool is not None
        pb = self.pool.layout.page_bytes
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.numel() * t.element_size() != pb:
            raise ValueError(f"a page is a contiguous tensor of {pb} bytes (the pool's flat data page)")
        return t.view(-1).view(torch.uint8)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        with self._keyed() as kc:
            return self._batch_get(kc, keys, target_locations, target_sizes)

    def _batch_get(self, kc: KeyedPagesClient | None, keys: list[str], target_locations: Any,
                   target_sizes: Any) -> list[Any]:
        pool = self.pool
        if kc is None or pool is None or not keys:
            return [None] * len(keys)
        if target_locations is None:
            target_locations = [torch.empty(pool.pages[0].numel(), dtype=pool.dtype) for _ in keys]
        if len(target_locations) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(target_locations)} target locations")
        dst = [self._flat(t) for t in target_locations]
        f = kc.fetch(self._page_keys(keys)[0])
        if f is None:
            return [None] * len(keys)
        try:
            if not kc.mapped(f.host_pages):
                return [None] * len(keys)
            raw = pool.arena_pages(kc.client.arena).view(-1, pool.layout.page_bytes // pool.dtype.itemsize)
            out: list[Any] = [None] * len(keys)
            for i in np.flatnonzero(f.host_pages >= 0).tolist():
                dst[i].copy_(raw[int(f.host_pages[i])].view(torch.uint8))
                out[i] = target_locations[i]
            return out
        finally:
            kc.release(f)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        with self._keyed() as kc:
            return self._batch_set(kc, keys, values, target_locations, target_sizes)

    def _batch_set(self, kc: KeyedPagesClient | None, keys: list[str], values: Any, target_locations: Any,
                   target_sizes: Any) -> bool:
        pool = self.pool
        if kc is None or pool is None or values is None or not keys:
            return False
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(values)} values")
        src = [self._flat(v) for v in values]
        if not self.writer:
            return True
        page_keys, tokens = self._page_keys(keys)
        r = kc.store(page_keys, tokens)  # the tensor API passes no prefix
        if r is None:
            return False
        if not kc.mapped(r.host_pages):
            kc.store_done(r, ok=False)
            return False
        ok = False
        try:
            raw = pool.arena_pages(kc.client.arena).view(-1, pool.layout.page_bytes // pool.dtype.itemsize)
            for i in np.flatnonzero(r.host_pages >= 0).tolist():
                raw[int(r.host_pages[i])].view(torch.uint8).copy_(src[i])
            ok = True
        finally:
            done = kc.store_done(r, ok)
        return done is not None

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    # -- the rest --------------------------------------------------------------------------
    def clear(self) -> bool:
        """Not done: the store is shared by every instance (and survives restarts);
        an admin empties it with `hicache flush`."""
        log.warning("hicache: clear() ignored: the cache is shared by every SGLang instance; "
                    "an admin runs `hicache flush host` / `hicache flush disk`")
        return False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        if self.pool is not None:
            self.pool.close()


__all__ = ["HiCacheStore", "PoolPages"]
