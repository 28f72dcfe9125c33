"""CachedEngine: the reference engine serving requests through hicache, as vLLM or SGLang would.

Per request (one at a time; the model runs one sequence per step here):

  lookup(prompt[:-1])    the cached prefix: pages already in this engine's pool,
                         then a host part whose per-layer copy into fresh pages
                         starts now (the daemon may first read part of it from disk)
  prefill(suffix, layer_hook=prefix.wait_layer)
                         layer l's attention waits for layer l of that copy only;
                         a prefill that loads nothing is timed (note_prefill): the
                         daemon's fetch-or-recompute rule needs the engine's rate
  finish_load            the copied pages become cached device pages
  decode N tokens
  store(prefix, tokens, pages)
                         insert the full pages (write-through backup to host)
  release                unpin; the request's private pages go back to the allocator

Matching `prompt[:-1]` (SGLang does the same) leaves at least one prompt token
to compute even when the whole prompt is cached, since the engine needs that
token's logits; the alternative, pinning and loading the last page only to
give it back, costs a copy for nothing.

Page ownership. `Engine` owns the slots it allocates and never frees the
prefix slots it is lent; `EngineCache` owns cached pages and a request's
private pages. At the end of a request `Engine.free(req, keep=seq_len)` frees
nothing and hands every page it allocated to `store`, which files the full
pages it inserted as cached and the rest (the partial last page, duplicates
of pages the cache already had) as private; `release` frees those. A request
that cannot get pages even after eviction gives its own pages back with
`Engine.free(req)` and its prefix with `release`.

Under pool pressure the engine asks the daemon for cached pages back
(`EngineCache.evict`) and retries; pages that a running backup still reads are
freed once the backup is reported, so it waits for backups before giving up.
With the daemon unreachable, `evict` takes the cached pages back itself, so a
request that fits the pool is never refused for the daemon's sake.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.client.client import HiCacheClient
from hicache.client.deadlines import CallDeadlines
from hicache.client.engine_cache import EngineCache, Prefix
from hicache.engine.attention import EngineError
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.engine.runner import Engine, Request
from hicache.tiers.device.allocator import PagedTokenToKVPoolAllocator
from hicache.tiers.device.pool import DevicePool

log = logging.getLogger(__name__)

BACKUP_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Generation:
    """One served request. Token counts cover the prompt only."""

    output_ids: list[int]
    prompt_tokens: int
    device_tokens: int  # prefix tokens already in this engine's pool
    host_tokens: int  # prefix tokens copied in from the host tier
    disk_tokens: int  # prefix tokens the daemon read from disk, then copied in
    computed_tokens: int  # prompt tokens run through the model
    ttft_s: float  # lookup + load + prefill, until the first token is known
    logits: list[torch.Tensor] | None = None  # per generated token `[vocab]`, with keep_logits

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.disk_tokens


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    failed: int = 0  # the pool could not hold the request even after eviction
    prompt_tokens: int = 0
    computed_tokens: int = 0
    device_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    generated_tokens: int = 0
    evicted_pages: int = 0  # cached pages given back to make room
    ttft_s: list[float] = field(default_factory=list)

    @property
    def saved_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    def add(self, g: Generation) -> None:
        self.requests += 1
        self.prompt_tokens += g.prompt_tokens
        self.computed_tokens += g.computed_tokens
        self.device_tokens += g.device_tokens
        self.host_tokens += g.host_tokens
        self.disk_tokens += g.disk_tokens
        self.generated_tokens += len(g.output_ids)
        self.ttft_s.append(g.ttft_s)


def model_name(config: ModelConfig) -> str:
    """The namespace model id: equal configs (hence equal weights) share pages, others never do."""
    digest = hashlib.blake2b(repr(config).encode(), digest_size=6).hexdigest()
    return f"hicache-tiny-{config.attention}-{digest}"


class CachedEngine:
    """`Engine` + `EngineCache`; with `cache=None` the same engine computes every prompt from scratch."""

    def __init__(self, model: TinyTransformer, device_pool: DevicePool, allocator: PagedTokenToKVPoolAllocator,
                 cache: EngineCache | None, max_requests: int = 4) -> None:
        if cache is not None and (cache.pool is not device_pool or cache.allocator is not allocator):
            raise EngineError("the EngineCache must manage this engine's own pool and allocator")
        self.engine = Engine(model, device_pool, allocator, max_requests=max_requests)
        self.model = model
        self.pool = device_pool
        self.allocator = allocator
        self.cache = cache
        self.page_size = device_pool.page_size
        self.stats = EngineStats()

    @classmethod
    def create(cls, config: ModelConfig | TinyTransformer, *, page_size: int = 16, device_pages: int = 64,
               socket_path: str | None = None, use_cache: bool = True, timeout_s: float | None = None,
               backoff_s: tuple[float, float] = (0.05, 2.0), device: str | torch.device = "cpu",
               deadlines: CallDeadlines | None = None) -> CachedEngine:
        """A model (or a shared one), its own device pool and, with `use_cache`, a daemon
        connection. The pool lives where the model does (`device` builds a new model there).
        `deadlines` (default CallDeadlines()) or `timeout_s` (one for every call) bound each
        daemon call; a hung daemon costs the first connect at most `connect_s` per step."""
        model = config if isinstance(config, TinyTransformer) else TinyTransformer(config, device=device)
        pool = DevicePool(model.layout(page_size), num_slots=device_pages * page_size, device=model.device)
        allocator = PagedTokenToKVPoolAllocator(pool.num_slots, page_size, device=model.device)
        cache = None
        if use_cache:
            client = HiCacheClient(pool.layout, pool.num_pages, model=model_name(model.config),
                                   socket_path=socket_path, timeout_s=timeout_s, backoff_s=backoff_s,
                                   deadlines=deadlines)
            cache = EngineCache(client, pool, allocator)
        return cls(model, pool, allocator, cache)

    # -- serving -------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, keep_logits: bool = False
                 ) -> Generation | None:
        """Greedy decoding of `max_new_tokens` after `prompt`, through the cache.

        Returns None (everything given back, nothing cached) when the device
        pool cannot hold the request even after evicting every cached page.
        """
        prompt = self._check(prompt, max_new_tokens)
        t0 = time.perf_counter()
        prefix = self.cache.lookup(np.asarray(prompt[:-1], dtype=np.int32)) if self.cache is not None else None
        req = Request(list(prompt))
        try:
            loading = prefix is not None and prefix.load is not None
            t_model = time.perf_counter()
            logits = self._prefill(req, prefix)
            if logits is None:
                return self._fail(req, prefix)
            out = [int(logits[0].argmax())]  # waits for the device: the prefill is done
            ttft = time.perf_counter() - t0
            if self.cache is not None and not loading:  # a prefill under a load would time the copy too
                self.cache.client.note_prefill(len(prompt) - req.prefix_len, time.perf_counter() - t_model)
            kept = [logits[0].clone()] if keep_logits else None
            if prefix is not None:
                self.cache.finish_load(prefix)
            while len(out) < max_new_tokens:
                req.token_ids.append(out[-1])
                logits = self._decode(req)
                if logits is None:
                    return self._fail(req, prefix)
                out.append(int(logits[0].argmax()))
                if kept is not None:
                    kept.append(logits[0].clone())
        except BaseException:
            self._give_back(req, prefix)
            raise
        gen = self._generation(prompt, prefix, req.prefix_len, out, ttft, kept)
        self._finish(req, prefix)
        self.stats.add(gen)
        return gen

    def _check(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Reject a bad request before anything is pinned or allocated."""
        if max_new_tokens < 1:
            raise EngineError("max_new_tokens must be >= 1")
        ids = [int(t) for t in prompt]
        if not ids:
            raise EngineError("an empty prompt")
        if len(ids) + max_new_tokens - 1 > self.engine.max_context_len:
            raise EngineError(f"prompt + new tokens exceed max_context_len {self.engine.max_context_len}")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise EngineError(f"token ids must lie in 0..{vocab - 1}")
        return ids

    def _prefill(self, req: Request, prefix: Prefix | None) -> torch.Tensor | None:
        slots = self._slots(prefix.device_pages) if prefix is not None else torch.empty(0, dtype=torch.int64)
        hook = prefix.wait_layer if prefix is not None else None
        need = -(-(len(req.token_ids) - slots.numel()) // self.page_size)
        while True:
            logits = self.engine.prefill([req], [slots], layer_hook=hook)
            if logits is not None or not self._make_room(need):
                return logits

    def _decode(self, req: Request) -> torch.Tensor | None:
        while True:
            logits = self.engine.decode([req])
            if logits is not None or not self._make_room(1):
                return logits

    def _generation(self, prompt: list[int], prefix: Prefix | None, prefix_len: int, out: list[int],
                    ttft: float, kept: list[torch.Tensor] | None) -> Generation:
        device = host = disk = 0
        if prefix is not None:
            m, ps = prefix.match, self.page_size
            device = m.device_len * ps
            if prefix.num_pages > m.device_len:  # the host part was copied in
                disk = m.from_disk * ps
                host = m.host_len * ps - disk
        assert device + host + disk == prefix_len
        return Generation(out, len(prompt), device, host, disk, len(prompt) - prefix_len, ttft, kept)

    def _finish(self, req: Request, prefix: Prefix | None) -> None:
        """Hand the request's pages to the cache (full ones cached, the rest freed at release)."""
        if prefix is None:
            self.engine.free(req)
            return
        ps = self.page_size
        tokens = np.asarray(req.token_ids[:req.seq_len], dtype=np.int32)  # the tokens whose KV is in the pool
        own = (req.slots[req.prefix_len::ps] // ps).cpu().numpy().astype(np.int64)
        self.engine.free(req, keep=req.seq_len)  # frees nothing: every page it allocated passes to the cache
        self.cache.store(prefix, tokens, own)
        self.cache.release(prefix)

    def _fail(self, req: Request, prefix: Prefix | None) -> None:
        self._give_back(req, prefix)
        self.stats.failed += 1
        log.warning("a request of %d tokens does not fit a pool of %d pages", len(req.token_ids),
                    self.pool.num_pages)
        return None

    def _give_back(self, req: Request, prefix: Prefix | None) -> None:
        """Undo a request that will not finish: its own pages, then its prefix (nothing is cached)."""
        if req.resident:
            self.engine.free(req)
        if prefix is not None:
            self.cache.release(prefix)

    # -- pool pressure ----------------------------------------------------------------
    def _make_room(self, num_pages: int) -> bool:
        """Evict cached pages until `num_pages` are free; False when nothing more can go."""
        if self.cache is None:
            return False
        ps = self.page_size
        while self.allocator.available_size() // ps < num_pages:
            before = self.allocator.available_size()
            self.stats.evicted_pages += self.cache.evict(num_pages - before // ps)
            if self.allocator.available_size() > before:
                continue
            if not self.cache.backups or not self.wait_backups():
                return False  # what is left is pinned by running requests, or not ours to free
        return True

    def wait_backups(self, timeout_s: float = BACKUP_WAIT_S) -> bool:
        """Report every running backup (the pages become host-resident). False on timeout."""
        if self.cache is None:
            return True
        deadline = time.monotonic() + timeout_s
        self.cache.poll()
        while self.cache.backups:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
            self.cache.poll()
        return True

    def drain(self) -> None:
        """Finish backups and give every cached device page back to the allocator."""
        if self.cache is None:
            return
        self.wait_backups()
        while self.cache.evict(self.pool.num_pages) > 0:
            pass

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        base = torch.from_numpy(np.asarray(pages, dtype=np.int64)) * self.page_size
        return (base[:, None] + torch.arange(self.page_size)).reshape(-1).to(self.pool.device)
