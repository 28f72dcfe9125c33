"""The remote-store interface: what the remote tier (L4) needs from a shared store.

A backend moves opaque records under page addresses; it knows nothing of the
index, the arena or the record format (hicache/tiers/remote/record.py), so a
second store (Mooncake Store: hicache/tiers/remote/mooncake/store.py) is one more
subclass and no change to the daemon.

Contract:
- Every method is a coroutine run on the remote worker's own event loop
  (hicache/tiers/remote/worker.py), never on the daemon's; a backend may block
  that loop only briefly (it serves every lookup's probe).
- Methods raise `RemoteStoreError` (or let the client library's errors through:
  the worker counts any exception as a failure); the caller enforces deadlines
  by cancelling, so a backend must tolerate cancellation at any await (drop the
  connection whose exchange was interrupted).
- No retries inside a backend: the caller's circuit breaker decides when to try
  again. A store may lose any record at any time (eviction, restart): answers
  are hints, verified by the reader.
"""

from __future__ import annotations

import importlib
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.errors import ConfigError, HiCacheError

# URL scheme -> "module:class" of the backend serving it. A new store is a module
# with a RemoteStore subclass and a line here; the daemon opens
# whatever `remote_url` names through open_store() and knows no backend.
BACKENDS = {
    "redis": "hicache.tiers.remote.redis_store:RedisStore",
    "rediss": "hicache.tiers.remote.redis_store:RedisStore",
    "unix": "hicache.tiers.remote.redis_store:RedisStore",
    "mooncake": "hicache.tiers.remote.mooncake.store:MooncakeStore",
}


class RemoteStoreError(HiCacheError):
    """The remote store refused or failed an operation."""


class PartialWrite(RemoteStoreError):
    """Some records of a put were stored, others failed (a node down, a slot moved)."""

    def __init__(self, stored: int, cause: BaseException) -> None:
        super().__init__(f"{stored} records stored, then: {type(cause).__name__}: {cause}")
        self.stored = stored
        self.cause = cause


@dataclass(frozen=True, slots=True)
class PageAddress:
    """Where a page lives in a remote store: its namespace, its key, and the key of the
    first page of its run (pages of one run share a shard: see RUN_PAGES)."""

    salt: bytes
    key: bytes
    run: bytes


# Pages of a prefix are grouped in runs of this many consecutive pages. A run is one
# shard of a partitioned store (one Redis Cluster hash slot): one multi-key command per
# run instead of one per page, while consecutive runs land on independent shards, so a
# long prefix is read from every node in parallel. 16 pages are 256 tokens at page size
# 16 (1-64 MiB of KV); a prompt shorter than that lives on one node.
RUN_PAGES = 16


def address(salt: bytes, keys: Sequence[bytes], i: int) -> PageAddress:
    """The address of keys[i], where `keys` is a whole prefix from its first page (the
    run of page i starts at page i - i % RUN_PAGES)."""
    return PageAddress(salt, keys[i], keys[i - i % RUN_PAGES])


def addresses(salt: bytes, keys: Sequence[bytes], start: int, stop: int) -> list[PageAddress]:
    """address() of keys[start:stop]."""
    return [PageAddress(salt, keys[i], keys[i - i % RUN_PAGES]) for i in range(start, stop)]


class RemoteStore(ABC):
    """A shared store of page records. See the module docstring for the contract.
    Constructed as cls(url, password_file=..., timeout_s=...) by open_store()."""

    @classmethod
    def check_url(cls, url: str) -> None:
        """Raise ConfigError (with the URL redacted) for a URL this backend cannot use."""

    @abstractmethod
    async def connect(self) -> None:
        """(Re)connect; raises when the store cannot be reached."""

    @abstractmethod
    async def ping(self) -> None:
        """One cheap round trip; raises when the store does not answer."""

    @abstractmethod
    async def exists(self, pages: Sequence[PageAddress]) -> list[bool]:
        """Which pages the store holds now (one round trip; the answer may be stale)."""

    @abstractmethod
    async def get(self, pages: Sequence[PageAddress], record_bytes: int = 0) -> list[bytes | None]:
        """The records of `pages`, None where missing. `record_bytes` is the largest record
        the caller accepts (0: any): a store that reads into preallocated buffers sizes
        them by it."""

    @abstractmethod
    async def put(self, records: Sequence[tuple[PageAddress, memoryview]], ttl_s: float) -> int:
        """Store records (overwriting; `ttl_s` > 0 lets the store expire them); returns how
        many were stored, or raises PartialWrite when only some were."""

    async def has_room(self) -> bool | None:
        """Whether the store takes more records without evicting any (the remote admission
        filters writes only when it does not); None: it cannot say."""
        return None

    @abstractmethod
    async def delete_namespace(self, salt: bytes) -> int:
        """Delete every record of the namespace; returns how many were deleted."""

    @abstractmethod
    async def close(self) -> None:
        """Drop connections."""

    @abstractmethod
    def describe(self) -> dict:
        """What to show in stats and logs: kind, mode, address — never a credential."""


def redact_url(url: str) -> str:
    """The URL with any user name and password replaced by `***`."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if "@" not in parts.netloc:
        return url
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def backend_for(url: str) -> type[RemoteStore]:
    """The RemoteStore class for `url`'s scheme; ConfigError (naming only the redacted
    URL) for a scheme no backend serves or a URL it refuses (its `check_url`)."""
    try:
        scheme = urllib.parse.urlsplit(url).scheme
    except ValueError as e:
        raise ConfigError(f"remote_url {redact_url(url)!r} is not a valid URL: {e}") from None
    target = BACKENDS.get(scheme)
    if target is None:
        raise ConfigError(f"remote_url {redact_url(url)!r}: the scheme must be one of {tuple(BACKENDS)}")
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    cls.check_url(url)
    return cls


def open_store(url: str, *, password_file: str = "", timeout_s: float = 1.0) -> RemoteStore:
    """The store `url` names (not connected yet: the remote worker connects it)."""
    return backend_for(url)(url, password_file=password_file, timeout_s=timeout_s)
