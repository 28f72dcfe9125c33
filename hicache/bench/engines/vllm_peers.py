"""The KV-cache configurations `hicache bench vllm --compare` runs vLLM with, each behind one
name, and the servers they need (a hicache daemon, an `lmcache server`), started and stopped
around one vLLM process.

- none:       vLLM alone.
- hicache:    HiCacheConnector, a daemon with a 1 GiB host tier and its LMDB disk tier.
- hicache-host: the same daemon without its disk tier (`--no-disk`): host memory only, as
              `lmcache` keeps its L1 only.
- lmcache:    vLLM's LMCacheMPConnector against an LMCache 0.5.6 MP server: 1 GiB L1, LRU,
              chunk = block size (32), shared-memory transfers driven by the server.
- lmcache-fs: the same plus LMCache's file-system L2 adapter in the workdir.
- lmcache-chunk256: the lmcache server at its default chunk size (256 tokens).

A hicache configuration may name where its daemon runs: `hicache:cpus=1:nice=-10`
(hicache/bench/engines/vllm_placement.py), each such name its own daemon.

LMCache is not a hicache dependency: `scripts/install_lmcache.sh` installs it (CPU-only, no
CUDA packages). Its save / load rates come from the server's own log lines
("Stored N tokens in S seconds", "Retrieved ..."): it reports no transfer stats to vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.bench.engines.vllm_placement import DaemonPlacement
from hicache.daemon.serve.launcher import LocalDaemon

log = logging.getLogger(__name__)

PEERS = ("none", "hicache", "hicache-host", "lmcache", "lmcache-fs", "lmcache-chunk256")
BASE = "none"  # the configuration every other is compared with (and must generate the same tokens as)
# Every run gets the same CPU budget (vllm_bench.py's docstring says why).
EQUAL_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
INSTALL_HINT = "LMCache is not installed: run `bash scripts/install_lmcache.sh` (lmcache==0.5.6, CPU-only)"
_TRANSFER = re.compile(r"(Stored|Retrieved) (\d+) tokens in ([0-9.eE+-]+) seconds")


class OutputsDiffer(Exception):
    """A configuration's outputs are not vLLM alone's: its numbers measure something else."""


@dataclass(frozen=True)
class PeerRun:
    """What one vLLM run needs to use a configuration, and where its transfer stats are."""

    name: str
    connector: dict[str, Any] | None  # KVTransferConfig fields; None: vLLM alone
    socket: str | None = None  # the hicache daemon's (the driver settles its puts between turns)
    server_log: Path | None = None  # an LMCache server's log: its transfer lines
    daemon_log: Path | None = None  # the hicache daemon's


def split_name(name: str) -> tuple[str, DaemonPlacement]:
    """`hicache:cpus=1:nice=-5` -> ("hicache", its placement); ValueError if either is bad."""
    base, *options = name.split(":")
    if base not in PEERS:
        raise ValueError(f"unknown --compare config {base}; known: {', '.join(PEERS)}")
    if options and not base.startswith("hicache"):
        raise ValueError(f"{name}: only a hicache daemon takes placement options")
    return base, DaemonPlacement.parse(options)


def parse_compare(text: str) -> list[str]:
    """`none,hicache,lmcache` -> names, each known and given once; `none` is always measured (first)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        split_name(n)
    if len(set(names)) != len(names):
        raise ValueError(f"--compare names a config twice: {text}")
    return ["none"] + [n for n in names if n != "none"]


def lmcache_available() -> bool:
    return importlib.util.find_spec("lmcache") is not None


@contextmanager
def start_peer(name: str, workdir: Path, block_size: int) -> Iterator[PeerRun]:
    """Start what `name` needs under workdir/NAME, yield how vLLM reaches it, stop it after."""
    home = workdir / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    home.mkdir(parents=True, exist_ok=True)
    base, placement = split_name(name)
    if base == "none":
        yield PeerRun(name, None)
    elif base.startswith("hicache"):
        # an empty cache and a log of this run only, whatever an earlier run left in the workdir
        disk = ["--no-disk"] if base == "hicache-host" else ["--disk-capacity", "2GiB", "--reset-disk"]
        (home / "daemon" / "daemon.log").unlink(missing_ok=True)
        with LocalDaemon(home / "daemon", "--host-capacity", "1GiB", *disk, *placement.serve_flags()) as daemon:
            assert daemon.proc is not None
            group = placement.apply(daemon.proc.pid, name)
            connector = {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.integrations.vllm",
                         "kv_role": "kv_both", "kv_connector_extra_config": {"socket": daemon.socket}}
            try:
                yield PeerRun(name, connector, socket=daemon.socket, daemon_log=daemon.log_path)
            finally:
                daemon.stop()
                if group is not None:
                    group.remove()
                # its disk tier is an LMDB file allocated whole (2 GiB): a run's leftovers would fill
                # the disk of whoever benches often; the log stays
                shutil.rmtree(Path(daemon.state_dir), ignore_errors=True)
    elif base.startswith("lmcache"):
        chunk = 256 if base == "lmcache-chunk256" else block_size
        flags = ["--chunk-size", str(chunk), "--l1-size-gb", "1", "--eviction-policy", "LRU"]
        if base == "lmcache-fs":
            shutil.rmtree(home / "l2", ignore_errors=True)  # an empty cache, as hicache's
            (home / "l2").mkdir()
            flags += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(home / "l2")})]
        with LMCacheServer(home, flags) as server:
            extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port,
                     "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
            connector = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": extra}
            yield PeerRun(name, connector, server_log=server.log_path)
    else:
        raise ValueError(f"unknown config {name}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """`lmcache server` as a child process on loopback ports of its own; observability off
    (its Prometheus exporter is one of the packages the CPU install leaves out)."""

    def __init__(self, workdir: Path, flags: list[str]) -> None:
        self.port = _free_port()
        self.log_path = workdir / "lmcache-server.log"
        self.args = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
                     "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(_free_port()),
                     "--disable-observability", *flags]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LMCacheServer:
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            self._wait_ready(timeout_s=300.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until its request port accepts a connection (it binds once its engine is built)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.read_log()[-4000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"lmcache server did not listen in {timeout_s:.0f}s:\n{self.read_log()[-4000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            log.warning("lmcache server did not stop in 30s; killing it")
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def lmcache_transfers(log_path: Path) -> dict[str, float]:
    """Tokens and seconds the server reported storing and retrieving."""
    out = {"saved_tokens": 0.0, "save_s": 0.0, "loaded_tokens": 0.0, "load_s": 0.0}
    for verb, tokens, seconds in _TRANSFER.findall(log_path.read_text(errors="replace")):
        tokens_key, seconds_key = ("saved_tokens", "save_s") if verb == "Stored" else ("loaded_tokens", "load_s")
        out[tokens_key] += float(tokens)
        out[seconds_key] += float(seconds)
    return out


def bench_setup(args: Any, prefix: str) -> tuple[list[str], Path, Path]:
    """What every `bench vllm` mode starts from: the configurations of `--compare` (LMCache's
    install hint and exit 2 where it is asked for and missing), the work directory, and the
    tiny Llama built there."""
    from hicache.bench.engines.tiny_llama import build_tiny_llama

    names = args.compare if isinstance(args.compare, list) else parse_compare(args.compare)
    if any(n.startswith("lmcache") for n in names) and not lmcache_available():
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(workdir / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads)
    return names, workdir, model
