"""A local Mooncake Store for the remote-tier tests and benchmark: one `mooncake_master`
(with its built-in HTTP metadata server, no etcd) and N `mooncake_client` storage
processes ("machines": each lends `segment_mib` of memory), on free loopback ports in a
directory of their own (their logs).

Every wait is on a condition against a deadline: the master's /metrics page reports
the capacity of every storage process mounted. The binaries come with the PyPI wheel
(`mooncake-transfer-engine-non-cuda`); every process gets MC_TCP_BIND_ADDRESS, or it
would advertise its endpoints on the first NIC.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hicache.errors import HiCacheError

HOST = "127.0.0.1"


def mooncake_binary(name: str) -> str | None:
    """The path of `mooncake_master` or `mooncake_client` shipped with the installed wheel."""
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / name
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def mooncake_missing() -> str | None:
    """What this machine lacks to run a local Mooncake Store, or None."""
    if mooncake_binary("mooncake_master") is None or mooncake_binary("mooncake_client") is None:
        return "the Mooncake wheel (pip install mooncake-transfer-engine-non-cuda)"
    try:
        import mooncake.store  # noqa: F401 - needs libibverbs.so.1 even for TCP
    except ImportError as e:
        return f"a loadable mooncake.store ({e}; apt-get install libibverbs1)"
    return None


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise HiCacheError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def mc_env() -> dict[str, str]:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": HOST, "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "1")}


@dataclass
class LocalMooncake:
    root: Path
    storage: int = 1  # storage processes, one per simulated machine
    segment_mib: int = 256
    client_ttl_s: int = 10  # how long the master trusts a storage process it no longer hears from
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    master: subprocess.Popen | None = None
    clients: list[subprocess.Popen | None] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def url(self) -> str:
        """The daemon's `remote_url` for this store."""
        return f"mooncake://{self.master_address}?metadata={self.metadata_url}&local_host={HOST}"

    def start(self) -> LocalMooncake:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.rpc_port:
            self.rpc_port, self.metadata_port, self.metrics_port = free_ports(3)
        self.start_master()
        self.client_ports = self.client_ports or free_ports(self.storage)
        self.clients = [None] * self.storage
        for i in range(self.storage):
            self.start_storage(i)
        return self

    def start_master(self) -> None:
        """(Re)start the master on its ports; without HA a restarted master knows no key."""
        args = [mooncake_binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={self.metadata_port}", f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}", f"--client_ttl={self.client_ttl_s}"]
        log = open(self.root / "master.log", "ab")
        self.master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=mc_env(),
                                       start_new_session=True)
        log.close()
        _wait(lambda: self.metric("master_total_capacity_bytes") is not None, 30, "mooncake_master")

    def start_storage(self, i: int) -> None:
        args = [mooncake_binary("mooncake_client"), f"--host={HOST}", f"--port={self.client_ports[i]}",
                f"--global_segment_size={self.segment_mib}MB", f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_url}", "--protocol=tcp"]
        log = open(self.root / f"storage{i}.log", "ab")
        self.clients[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=mc_env(),
                                           start_new_session=True)
        log.close()
        self.wait_capacity()

    def wait_capacity(self, timeout_s: float = 30.0) -> None:
        """Until the master counts the memory of every running storage process, and only
        theirs (a killed one's is dropped `client_ttl_s` after its last heartbeat)."""
        want = sum(1 for c in self.clients if c is not None and c.poll() is None) * self.segment_mib << 20
        _wait(lambda: self.metric("master_total_capacity_bytes") == want, timeout_s + self.client_ttl_s,
              f"{want >> 20} MiB of mooncake storage to mount")

    def metric(self, name: str) -> float | None:
        """One value of the master's Prometheus page, None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=1.0) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def kill_master(self) -> None:
        _kill(self.master)
        self.master = None

    def kill_storage(self, i: int) -> None:
        _kill(self.clients[i])
        self.clients[i] = None

    def stop(self) -> None:
        for i in range(len(self.clients)):
            self.kill_storage(i)
        self.kill_master()


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
