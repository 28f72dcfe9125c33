"""RedisStore: the remote tier on Redis or Valkey, standalone or Cluster (redis-py asyncio).

Key layout (bytes, hex so that `SCAN MATCH` needs no escaping):

    hc1:<namespace salt, 32 hex>:{<first 8 bytes of the run's first page key, 16 hex>}<page key, 32 hex>

The `{...}` hash tag is the run (hicache/tiers/remote/store.py RUN_PAGES): the pages
of one run share a Cluster slot, so a run is read with one MGET and probed with one
EXISTS, and consecutive runs of a prefix land on independent slots, spreading a long
prefix over every master. Tagging by namespace would put a model's whole cache on one
node; no tag at all would cost one command per page. The salt leads the key so one
namespace's records are one `SCAN MATCH hc1:<salt>:*` away (admin flush).

Errors: redis-py retries only a broken connection, once and at once; never a timeout:
with its defaults a hung node costs seconds per command. Every failure surfaces at once and the remote worker's
circuit breaker decides when to try again. A cluster is detected by `INFO cluster`
(`cluster_enabled:1`) on the node the URL names; any node of a cluster works.

Credentials come from the URL (`redis://user:password@host:port`) or a password file
(which wins); `describe()` and every log line show the URL without them.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache.errors import ConfigError
from hicache.tiers.remote.store import PageAddress, PartialWrite, RemoteStore, RemoteStoreError, redact_url

log = logging.getLogger(__name__)

KEY_PREFIX = b"hc1:"
SCHEMES = ("redis", "rediss", "unix")
SCAN_COUNT = 1000
DELETE_BATCH = 512
ROOM_FRACTION = 0.9  # a master using more of its maxmemory evicts soon: the store is full


def check_url(url: str) -> None:
    """ConfigError (naming only the redacted URL) unless `url` is a Redis URL we can use."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ConfigError(f"remote_url {redact_url(url)!r} is not a valid URL: {e}") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"remote_url {redact_url(url)!r}: the scheme must be one of {SCHEMES}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"remote_url {redact_url(url)!r} names no host")


def read_password_file(path: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"remote_password_file {path}: {e.strerror or e}") from None
    password = text.strip("\r\n")
    if not password:
        raise ConfigError(f"remote_password_file {path} is empty")
    return password


def record_key(page: PageAddress) -> bytes:
    return b"%s%s:{%s}%s" % (KEY_PREFIX, page.salt.hex().encode(), page.run[:8].hex().encode(),
                             page.key.hex().encode())


def namespace_pattern(salt: bytes) -> bytes:
    return b"%s%s:*" % (KEY_PREFIX, salt.hex().encode())


class RedisStore(RemoteStore):
    check_url = staticmethod(check_url)

    def __init__(self, url: str, *, password_file: str = "", timeout_s: float = 1.0) -> None:
        check_url(url)
        self.url = url
        self.password = read_password_file(password_file) if password_file else None
        self.timeout_s = timeout_s
        self.client: Any = None  # redis.asyncio.Redis or RedisCluster once connected
        self.cluster = False
        self._known_nodes: list[tuple[str, int]] = []  # a cluster's nodes, as last seen

    def _options(self) -> dict[str, Any]:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # One immediate retry on a broken connection only (a pooled connection the server
        # closed, e.g. after its restart, fails the first command sent on it); never on a
        # timeout: a hung node must cost one deadline, not several.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        opts: dict[str, Any] = {"retry": retry, "socket_timeout": self.timeout_s,
                                "socket_connect_timeout": self.timeout_s}
        if self.password is not None:
            opts["password"] = self.password
        return opts

    async def connect(self) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.cluster import RedisCluster
        except ImportError as e:  # the extra is not installed
            raise RemoteStoreError("the remote tier needs redis-py: pip install 'hicache[remote]'") from e
        from redis.asyncio.cluster import ClusterNode

        await self.close()
        if not self._known_nodes:  # the first connection: is it a cluster?
            probe = aioredis.Redis.from_url(self.url, **self._options())
            try:
                info = await probe.info("cluster")
            finally:
                await probe.aclose()
            self.cluster = str(info.get("cluster_enabled", 0)) == "1"
        if self.cluster:
            # Every node seen before is a way in: the node the URL names may be the master
            # that died. require_full_coverage off: a cluster that lost a master without a
            # replica still serves the other slots (see ping() for how the tier treats it).
            client = RedisCluster.from_url(self.url, require_full_coverage=False,
                                           startup_nodes=[ClusterNode(h, p) for h, p in self._known_nodes],
                                           **self._options())
            try:
                await client.initialize()
            except BaseException:
                await client.aclose()
                raise
            self._known_nodes = sorted({(n.host, n.port) for n in client.get_nodes()})
        else:
            client = aioredis.Redis.from_url(self.url, **self._options())
        self.client = client
        log.info("remote tier: connected to %s (%s)", redact_url(self.url),
                 "cluster" if self.cluster else "standalone")

    def _require(self) -> Any:
        if self.client is None:
            raise RemoteStoreError("not connected")
        return self.client

    async def ping(self) -> None:
        client = self._require()
        if self.cluster:
            # every master must answer: PING on one node says nothing of the slots of another
            await client.ping(target_nodes=client.get_primaries())
        else:
            await client.ping()

    async def exists(self, pages: Sequence[PageAddress]) -> list[bool]:
        client = self._require()
        async with client.pipeline(transaction=False) as pipe:
            for page in pages:
                pipe.execute_command("EXISTS", record_key(page))
            return [bool(n) for n in _raise_first(await pipe.execute(raise_on_error=False))]

    async def get(self, pages: Sequence[PageAddress], record_bytes: int = 0) -> list[bytes | None]:
        client = self._require()
        runs = _runs(pages)
        async with client.pipeline(transaction=False) as pipe:
            for run in runs:  # one slot per run: MGET is legal on a cluster
                pipe.execute_command("MGET", *(record_key(p) for p in run))
            replies = _raise_first(await pipe.execute(raise_on_error=False))
        return [value for values in replies for value in values]

    async def put(self, records: Sequence[tuple[PageAddress, memoryview]], ttl_s: float) -> int:
        client = self._require()
        ttl_ms = int(ttl_s * 1000)
        async with client.pipeline(transaction=False) as pipe:
            for page, record in records:
                if ttl_ms > 0:
                    pipe.execute_command("SET", record_key(page), record, "PX", ttl_ms)
                else:
                    pipe.execute_command("SET", record_key(page), record)
            replies = await pipe.execute(raise_on_error=False)
        stored = sum(1 for r in replies if r is True or r == b"OK")
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors and not stored:
            raise errors[0]
        if errors:  # the caller's breaker must hear of it: a moved slot needs a fresh client
            raise PartialWrite(stored, errors[0])
        return stored

    async def has_room(self) -> bool:
        """No master near its `maxmemory` (none set: room, records then go only by their TTL)."""
        client = self._require()
        for node in client.get_primaries() if self.cluster else [None]:
            info = await (client.info("memory") if node is None else client.info("memory", target_nodes=node))
            for part in [info] if "used_memory" in info else list(info.values()):  # {node name: info}, maybe
                limit = int(part.get("maxmemory", 0))
                if limit and int(part.get("used_memory", 0)) > ROOM_FRACTION * limit:
                    return False
        return True

    async def delete_namespace(self, salt: bytes) -> int:
        client = self._require()
        nodes = client.get_primaries() if self.cluster else [None]
        deleted = 0
        for node in nodes:
            cursor: Any = 0
            while True:
                args = ("SCAN", cursor, "MATCH", namespace_pattern(salt), "COUNT", SCAN_COUNT)
                if node is None:
                    reply = await client.execute_command(*args)
                else:
                    reply = await client.execute_command(*args, target_nodes=node)
                cursor, keys = reply
                if isinstance(cursor, dict):  # redis-py's cluster SCAN: {node name: cursor}
                    cursor = next(iter(cursor.values()))
                for i in range(0, len(keys), DELETE_BATCH):
                    async with client.pipeline(transaction=False) as pipe:
                        for key in keys[i:i + DELETE_BATCH]:
                            pipe.execute_command("UNLINK", key)
                        deleted += sum(int(n) for n in _raise_first(await pipe.execute(raise_on_error=False)))
                if int(cursor) == 0:
                    break
        return deleted

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # a dead connection may fail to close: it is gone either way
                pass

    def describe(self) -> dict:
        return {"kind": "redis", "url": redact_url(self.url), "mode": "cluster" if self.cluster else "standalone",
                "password": "file" if self.password is not None else
                ("url" if urllib.parse.urlsplit(self.url).password else "none")}


def _runs(pages: Sequence[PageAddress]) -> list[list[PageAddress]]:
    """Consecutive pages grouped by their run (one hash slot each)."""
    runs: list[list[PageAddress]] = []
    for page in pages:
        if runs and runs[-1][0].run == page.run and runs[-1][0].salt == page.salt:
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs


def _raise_first(replies: list) -> list:
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return replies
