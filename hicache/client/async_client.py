"""An asyncio client: many requests in flight on one connection, responses matched
by id, and the KV event stream for routers (`subscribe`). Like the blocking
client it checks who listens (hicache/client/peer.py) before sending anything.

The handshake that passes the arena descriptor needs recvmsg, which asyncio
streams do not offer, so it runs on the plain socket before the stream wraps it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Collection
from typing import Any

from hicache.client.connection import RpcConnection
from hicache.errors import ClientError, DaemonUnavailable, ProtocolError
from hicache.rpc.framing import FrameDecoder, pack_frame, unpack_body

log = logging.getLogger(__name__)


class AsyncRpcConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: dict,
                 fds: list[int], max_frame_bytes: int = 256 << 20) -> None:
        self.reader, self.writer = reader, writer
        self.hello_result = hello
        self.fds = fds
        self._ids = itertools.count(2)  # 1 was the handshake
        self._waiters: dict[int, asyncio.Future] = {}
        self.events: asyncio.Queue[dict] = asyncio.Queue(maxsize=65536)
        self._decoder = FrameDecoder(max_frame_bytes)
        self._reader_task = asyncio.ensure_future(self._read_loop())
        self.closed = False

    @classmethod
    async def connect(cls, path: str, *, timeout_s: float = 5.0,
                      daemon_uids: Collection[int] | None = None) -> AsyncRpcConnection:
        """`daemon_uids`: trusted uids of the daemon besides this user and root (default per
        hicache/client/peer.py); DaemonUntrusted, with nothing sent, for any other."""
        def handshake() -> tuple[RpcConnection, dict, list[int]]:
            conn = RpcConnection.connect(path, timeout_s, daemon_uids)
            try:
                hello, fds = conn.hello()
            except BaseException:
                conn.close()
                raise
            return conn, hello, fds

        sync_conn, hello, fds = await asyncio.to_thread(handshake)
        sock = sync_conn.sock
        sock.setblocking(False)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot wrap the connection: {e}") from e
        return cls(reader, writer, hello, fds)

    async def call(self, method: str, params: dict[str, Any] | None = None, timeout_s: float | None = 10.0) -> Any:
        if self.closed:
            raise DaemonUnavailable("connection closed")
        req_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[req_id] = fut
        try:
            self.writer.write(pack_frame({"id": req_id, "method": method, "params": params or {}}))
            return await asyncio.wait_for(fut, timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            await self.close()
            raise DaemonUnavailable(f"{method} failed: {e!r}") from e
        finally:
            self._waiters.pop(req_id, None)

    async def _read_loop(self) -> None:
        error: Exception = DaemonUnavailable("the daemon closed the connection")
        try:
            while True:
                data = await self.reader.read(1 << 20)
                if not data:
                    break
                for body in self._decoder.feed(data):
                    self._dispatch(unpack_body(body))
        except (OSError, ProtocolError) as e:
            error = DaemonUnavailable(f"receive failed: {e}")
        except asyncio.CancelledError:
            pass
        self.closed = True
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(error)

    def _dispatch(self, msg: dict) -> None:
        if "event" in msg:
            if self.events.full():
                self.events.get_nowait()  # a slow consumer loses the oldest events, never the daemon
            self.events.put_nowait(msg["event"])
            return
        fut = self._waiters.get(msg.get("id"))  # type: ignore[arg-type]
        if fut is None or fut.done():
            return
        if "error" in msg:
            err = msg["error"]
            fut.set_exception(ClientError(str(err.get("code")), str(err.get("message"))))
        else:
            fut.set_result(msg.get("result"))

    async def subscribe(self) -> None:
        await self.call("subscribe")

    async def next_event(self) -> dict:
        return await self.events.get()

    async def close(self) -> None:
        if self.closed and self.writer.is_closing():
            return
        self.closed = True
        self._reader_task.cancel()
        self.writer.close()
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


class AsyncHiCacheClient:
    """Reconnecting asyncio client: `call` raises DaemonUnavailable while the daemon is away,
    and the next call after the backoff tries again."""

    def __init__(self, socket_path: str, backoff_s: tuple[float, float] = (0.05, 2.0),
                 daemon_uids: Collection[int] | None = None) -> None:
        self.socket_path = socket_path
        self.daemon_uids = daemon_uids
        self.conn: AsyncRpcConnection | None = None
        self._backoff = backoff_s[0]
        self._backoff_range = backoff_s
        self._next_try = 0.0

    async def _ensure(self) -> AsyncRpcConnection:
        if self.conn is not None and not self.conn.closed:
            return self.conn
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_try:
            raise DaemonUnavailable("daemon unavailable (backing off)")
        try:
            self.conn = await AsyncRpcConnection.connect(self.socket_path, daemon_uids=self.daemon_uids)
        except DaemonUnavailable:
            self._next_try = loop.time() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_range[1])
            raise
        self._backoff = self._backoff_range[0]
        return self.conn

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        conn = await self._ensure()
        return await conn.call(method, params)

    async def stats(self) -> dict:
        return await self.call("stats")

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
