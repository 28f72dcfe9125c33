"""redis-server beside `hicache bench scale`: the same count of values of the page's size,
their memory per key, and a save file's load at restart.

A standalone redis-server (hicache/bench/procs/redis_procs.py) without a memory limit
is filled with `SET` pipelined over one socket, measured (`used_memory`, the
process's RSS), saved (`SAVE`), killed with SIGKILL and started again on the
same directory; the restart is timed from the exec until `DBSIZE` answers the
full count (Redis answers LOADING while it reads the save file).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hicache.bench.daemon.scale_probe import memory_kib
from hicache.bench.procs.redis_procs import RedisNode, free_port, redis_server_binary
from hicache.errors import HiCacheError

CHUNK = 10_000  # SETs per pipelined write


@dataclass(slots=True)
class RedisFigures:
    keys: int
    fill_s: float
    bytes_per_key: float  # used_memory per key beyond the value
    rss_before_kib: int
    save_s: float
    restart_s: float  # exec to DBSIZE == keys
    rss_after_kib: int


def _fill(port: int, count: int, value_bytes: int) -> None:
    value = b"v" * value_bytes
    tail = b"$%d\r\n%s\r\n" % (value_bytes, value)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for lo in range(0, count, CHUNK):
            n = min(CHUNK, count - lo)
            s.sendall(b"".join(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n%s" % (len(k), k, tail)
                               for k in (b"k:%d" % i for i in range(lo, lo + n))))
            want, got = 5 * n, b""  # "+OK\r\n" each
            while len(got) < want:
                chunk = s.recv(want - len(got))
                if not chunk:
                    raise HiCacheError("redis-server closed the connection during the fill")
                got += chunk
            if got != b"+OK\r\n" * n:
                raise HiCacheError(f"redis-server refused a SET: {got[:200]!r}")


def _dbsize(node: RedisNode) -> int | None:
    try:
        reply = node.cmd("DBSIZE")
    except OSError:
        return None
    return int(reply[1:].split(b"\r\n", 1)[0]) if reply.startswith(b":") else None


def measure(workdir: Path, count: int, value_bytes: int, timeout_s: float = 600.0) -> RedisFigures:
    binary = redis_server_binary()
    if binary is None:
        raise HiCacheError("redis-server is not installed (Debian: apt-get install redis-server)")
    node = RedisNode(free_port(), workdir / "redis", extra_args=("--maxmemory", "0"))
    node.start(binary)
    try:
        used0 = int(node.info("memory")["used_memory"])
        t0 = time.monotonic()
        _fill(node.port, count, value_bytes)
        fill_s = time.monotonic() - t0
        used1 = int(node.info("memory")["used_memory"])
        assert node.proc is not None
        rss_before = memory_kib(node.proc.pid)["VmRSS"]
        t0 = time.monotonic()
        if not node.cmd("SAVE", timeout_s=timeout_s).startswith(b"+OK"):
            raise HiCacheError("redis-server SAVE failed")
        save_s = time.monotonic() - t0
        node.kill()
        t0 = time.monotonic()
        node.start(binary)
        deadline = t0 + timeout_s
        while _dbsize(node) != count:
            if time.monotonic() > deadline:
                raise HiCacheError(f"redis-server did not load {count} keys within {timeout_s:g}s")
            time.sleep(0.005)
        restart_s = time.monotonic() - t0
        rss_after = memory_kib(node.proc.pid)["VmRSS"]
    finally:
        node.kill()
    return RedisFigures(count, fill_s, (used1 - used0) / count - value_bytes, rss_before, save_s, restart_s,
                        rss_after)
