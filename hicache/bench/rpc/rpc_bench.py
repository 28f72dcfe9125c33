"""`hicache bench rpc`: match / insert round trips for an 8K-token prompt, against
two baselines measured in the same run with the same payload sizes (and, with
`--calls puts`, a vLLM step's put reservations pipelined against the same puts
sent one by one):

- a bare echo server with hicache's framing (asyncio + uvloop, 4-byte length +
  msgpack), which is the floor any RPC over this socket can reach;
- redis-server GET over a Unix socket (when redis-server is installed);
- with `servers`, native echo servers with the same framing (hicache/bench/rpc/native_echo.py:
  a C epoll loop; a C reader callback on uvloop answering in C, or calling a Python
  handler per frame), reported against redis GET and the Python echo server; with them,
  every echo server is also timed with a raw frame client as light as the redis one,
  and each client process's own CPU per call (the hicache client's against the raw
  client's) is reported: the client's part of a round trip.

Each client is its own process with a blocking socket, as engine schedulers are.
The three servers take turns, `repeats` rounds of each, and every percentile
reported is the median over the rounds of that round's percentile: one noisy
round on a shared machine moves no number alone. A `match` round trip is timed
without the `release` that follows it (still sent, untimed, and waited for).
Engines post their releases, but long before their next match; posting it in
this tight loop would time the daemon's handling of it too (measured: +10-40%
on a 1-client match p50).

Where the bench starts the daemon itself, each call kind also reports the daemon's
CPU time per client iteration against the echo server's per call (Linux schedstat of
each server's main thread over its rounds): steadier than latencies on a busy machine.

With `pin` (and two or more CPUs) the servers run on CPU 0 and the clients on
the others. Unpinned (the default), a 1-client round trip lands in one of two
groups by whether the scheduler put both ends on one core (see LIMITS.md); the
repeats' median steadies that, and pinned, every round trip pays the VM's
cross-core wake-up, which on this machine costs more than the work measured.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.bench.report import row
from hicache.bench.rpc import native_echo
from hicache.client.connection import RpcConnection
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.index.keys import page_keys
from hicache.layout import KVLayout
from hicache.rpc.framing import BlobRequest, ids_to_bytes, pack_frame

NATIVE_SERVERS = tuple(f"native-{v}" for v in native_echo.VARIANTS)  # `servers` choices
LAYOUT = KVLayout("mha", num_layers=32, page_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128)
STEP_PUTS = 8  # `puts`: the reservations of one vLLM step (its scheduler's requests), as one batch


# -- the echo baseline ------------------------------------------------------------------
def echo_server(path: str) -> None:
    """Answer every frame with a frame holding the same msgpack body, as a daemon would."""
    from hicache.rpc.framing import FrameDecoder, new_packer, unpack_body

    packer = new_packer()  # as the daemon does

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):  # type: ignore[no-untyped-def]
            self.t = transport
            self.dec = FrameDecoder(64 << 20)

        def data_received(self, data: bytes) -> None:
            for body in self.dec.feed(data):
                msg = unpack_body(body)
                self.t.write(pack_frame({"id": msg["id"], "result": msg.get("params")}, packer))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Echo, path=path)
        async with server:
            await server.serve_forever()

    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def _start_native(path: str, server: str) -> subprocess.Popen:
    variant = server.removeprefix("native-")
    return subprocess.Popen([sys.executable, "-c", f"from hicache.bench.rpc.native_echo import serve; "
                             f"serve({path!r}, {variant!r})"])


def _wait_socket(path: str, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Until the server accepts: its socket file appears at bind(), before listen()."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server for {path} did not start")
        time.sleep(0.02)


# -- clients --------------------------------------------------------------------------------
def _pct(xs: np.ndarray, q: float) -> float:
    return float(np.percentile(xs, q)) * 1e6


def _hicache_client(path: str, kind: str, n: int, tokens: np.ndarray, q: mp.Queue) -> None:
    conn = RpcConnection.connect(path, timeout_s=30)
    conn.hello()
    reg = conn.call("register", {"model": "bench", "layout": LAYOUT.to_dict(), "device_pages": 4096})
    engine, salt = reg["engine"], reg["salt"]
    keys = b"".join(page_keys(salt, tokens, LAYOUT.page_size))
    pages = ids_to_bytes(np.arange(1, len(tokens) // LAYOUT.page_size + 1))
    insert = {"engine": engine, "keys": keys, "tokens": tokens.tobytes(), "device_pages": pages}
    r = conn.call("insert", insert)
    if r["backup"]:
        conn.call("backup_done", {"backup": r["backup"]["id"]})
    match = BlobRequest("match", {"engine": engine}, "keys")  # as HiCacheClient.match sends it
    lat = np.empty(n)
    for i in range(n + 20):
        t0 = time.perf_counter()
        if kind == "match":
            m = conn.call_blob(match, keys)
            dt = time.perf_counter() - t0
            conn.call("release", {"pin": m["pin"]})  # waited (untimed): the next match finds the daemon idle
        else:
            conn.call("insert", insert)
            dt = time.perf_counter() - t0
        if i >= 20:
            lat[i - 20] = dt
    q.put(lat)
    conn.close()


def _puts_client(path: str, n: int, tokens: np.ndarray, q: mp.Queue) -> None:
    """An engine step's STEP_PUTS put reservations of fresh prompts, timed as one batch,
    alternating one by one (`call`) and pipelined (`call_many`); each batch's puts are then
    cancelled (untimed, waited) so the host tier never fills. Puts `[one by one, pipelined]`."""
    conn = RpcConnection.connect(path, timeout_s=30)
    conn.hello()
    reg = conn.call("register", {"model": "bench", "layout": LAYOUT.to_dict(), "device_pages": 1})
    engine, salt = reg["engine"], reg["salt"]
    rng = np.random.default_rng(int(tokens[0]))
    lat = np.empty((2, n))
    for i in range(n + 4):
        for pipelined in (False, True):
            batch = []
            for _ in range(STEP_PUTS):
                toks = rng.integers(0, 1 << 30, len(tokens), dtype=np.int32)
                batch.append(("put", {"engine": engine, "keys": b"".join(page_keys(salt, toks, LAYOUT.page_size)),
                                      "tokens": toks.tobytes()}))
            t0 = time.perf_counter()
            replies = conn.call_many(batch) if pipelined else [conn.call(m, p) for m, p in batch]
            dt = time.perf_counter() - t0
            conn.call_many([("put_done", {"engine": engine, "put": r["put"], "ok": False})
                            for r in replies if r["put"] is not None])
            if i >= 4:
                lat[int(pipelined), i - 4] = dt
    q.put(lat.T.copy())  # a row per batch: [one by one, pipelined]
    conn.close()


def _echo_client(path: str, kind: str, payload: dict, n: int, q: mp.Queue) -> None:
    """The hicache client's round trips of `kind`'s payload (a match's built as the daemon's
    rows build it)."""
    conn = RpcConnection.connect(path, timeout_s=30)
    blob = payload["keys"] if kind == "match" else None
    req = BlobRequest("echo", {k: v for k, v in payload.items() if k != "keys"}, "keys")
    lat = np.empty(n)
    cpu0 = time.thread_time()
    for i in range(n + 20):
        t0 = time.perf_counter()
        if blob is None:
            conn.call("echo", payload)
        else:
            conn.call_blob(req, blob)
        if i >= 20:
            lat[i - 20] = time.perf_counter() - t0
    q.put((lat, (time.thread_time() - cpu0) / (n + 20)))
    conn.close()


def _frame_client(path: str, frame: bytes, n: int, q: mp.Queue) -> None:
    """A request frame sent as prepared bytes, the answer read whole and not decoded: as
    little client work as `_redis_client` does, so that the server's own cost shows."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    buf = bytearray(2 * len(frame) + 4096)
    view = memoryview(buf)
    lat = np.empty(n)
    cpu0 = time.thread_time()
    for i in range(n + 20):
        t0 = time.perf_counter()
        s.sendall(frame)
        got, want = 0, 4
        while got < want:
            k = s.recv_into(view[got:])
            if not k:
                raise ConnectionResetError(f"{path}: the server closed the connection")
            got += k
            if want == 4 and got >= 4:
                want += int.from_bytes(buf[:4], "big")
        if i >= 20:
            lat[i - 20] = time.perf_counter() - t0
    q.put((lat, (time.thread_time() - cpu0) / (n + 20)))
    s.close()


def _redis_client(path: str, nbytes: int, n: int, q: mp.Queue) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    key = f"k{os.getpid()}".encode()
    value = os.urandom(nbytes)
    s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, len(value), value))
    assert s.recv(64).startswith(b"+OK")
    get = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key)
    want = len(f"${nbytes}\r\n") + nbytes + 2
    buf = bytearray(want)
    view = memoryview(buf)
    lat = np.empty(n)
    for i in range(n + 20):
        t0 = time.perf_counter()
        s.sendall(get)
        got = 0
        while got < want:
            got += s.recv_into(view[got:])
        if i >= 20:
            lat[i - 20] = time.perf_counter() - t0
    q.put(lat)
    s.close()


def _cpu_s(pid: int | None) -> float | None:
    """Seconds process `pid` has run on a CPU (its main thread; Linux schedstat), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _timed_cpu(pid: int | None, fn):  # type: ignore[no-untyped-def]
    """fn()'s result and the CPU seconds server `pid` spent meanwhile (None if unknown)."""
    t0 = _cpu_s(pid)
    out = fn()
    t1 = _cpu_s(pid)
    return out, (None if t0 is None or t1 is None else t1 - t0)


def _client_cpus() -> set[int] | None:
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[1:]) if len(cpus) > 1 else None


def _pinned(target, cpus: set[int] | None):  # type: ignore[no-untyped-def]
    def run(*args):  # type: ignore[no-untyped-def]
        if cpus:
            os.sched_setaffinity(0, cpus)
        target(*args)
    return run


def _run_clients(target, args_for, clients: int, cpus: set[int] | None = None,
                 client_cpu: list[float] | None = None) -> np.ndarray:
    """The clients' latencies, all together. Clients that time their own CPU per call put
    `(latencies, seconds)`; with `client_cpu`, the mean of those seconds is appended there."""
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_pinned(target, cpus), args=(*args_for(i), q)) for i in range(clients)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    own = [g[1] for g in got if isinstance(g, tuple)]
    if client_cpu is not None and own:
        client_cpu.append(float(np.mean(own)))
    return np.concatenate([g[0] if isinstance(g, tuple) else g for g in got])


def _echo_server_rows(label: str, servers: dict[str, tuple[list, list, list]], red: list, cpu_red: list,
                      n_calls: int, repeats: int) -> list[dict]:
    """Each echo server's percentiles against redis GET's (the echo server's where redis
    is missing), the ratio to the Python echo server's in `vs_echo`, with the hicache client
    and with the raw frame client; and its CPU per call against redis-server's per GET."""
    rows = []
    for name, (lats, cpus, raw) in servers.items():
        for client, rounds, echo in [("", lats, servers["echo"][0]), (", raw client", raw, servers["echo"][2])]:
            for q in (50, 99):
                value, base = _median_pcts(rounds, q), _median_pcts(red or echo, q)
                vs_echo = value / _median_pcts(echo, q)
                rows.append(row(f"{label} {name} server{client} p{q}", value, "us", baseline=base,
                                baseline_name="redis" if red else "echo", repeats=repeats, vs_echo=vs_echo,
                                note=f"{vs_echo:.2f}x echo"))
        if red and None not in cpus + cpu_red:
            rows.append(row(f"{label} {name} server CPU per call", float(np.median(cpus)) / n_calls * 1e6, "us",
                            baseline=float(np.median(cpu_red)) / n_calls * 1e6,
                            baseline_name="redis-server CPU per GET", repeats=repeats))
    return rows


# -- the benchmark --------------------------------------------------------------------------
def _median_pcts(rounds: list[np.ndarray], q: float) -> float:
    return float(np.median([_pct(lat, q) for lat in rounds]))


def _puts_rows(path: str, prompt_tokens: int, n: int, clients: int, repeats: int, cpus: set[int] | None,
               rng: np.random.Generator) -> list[dict]:
    """A step's puts pipelined against the same puts one by one, paired in each client."""
    one, many = [], []
    for _ in range(repeats):
        seeds = [rng.integers(0, 1 << 30, prompt_tokens, dtype=np.int32) for _ in range(clients)]
        lat = _run_clients(_puts_client, lambda i: (path, n, seeds[i]), clients, cpus)
        one.append(lat[:, 0])
        many.append(lat[:, 1])
    label = f"{STEP_PUTS} puts of {prompt_tokens} tokens pipelined, {clients} client{'s' if clients > 1 else ''}"
    return [row(f"{label} p{q}", _median_pcts(many, q), "us", baseline=_median_pcts(one, q),
                baseline_name="one by one", repeats=repeats) for q in (50, 99)]


def run(socket_path: str | None = None, prompt_tokens: int = 8192, requests: int = 2000,
        client_counts: tuple[int, ...] = (1, 8), repeats: int = 5, pin: bool = False,
        calls: tuple[str, ...] = ("match", "insert"), servers: tuple[str, ...] = ()) -> list[dict]:
    """`servers`: native echo servers (NATIVE_SERVERS) timed beside the others, each
    one taking its turn in every round; one that cannot be built here gets a row saying so."""
    unknown = [s for s in servers if s not in NATIVE_SERVERS]
    if unknown:
        raise ValueError(f"unknown servers {unknown}; known: {', '.join(NATIVE_SERVERS)}")
    tmp = Path(tempfile.mkdtemp(prefix="hicache-rpc-bench-"))
    procs: list[subprocess.Popen] = []
    daemon = None
    try:
        daemon_path = socket_path
        daemon = None
        if daemon_path is None:
            daemon = LocalDaemon(tmp / "daemon", "--host-capacity", "1GiB", "--no-disk").start()
            daemon_path = daemon.socket
        echo_path = str(tmp / "echo.sock")
        procs.append(subprocess.Popen([sys.executable, "-c", f"from hicache.bench.rpc.rpc_bench import echo_server; "
                                       f"echo_server({echo_path!r})"]))
        _wait_socket(echo_path, procs[-1])
        redis_path = None
        if shutil.which("redis-server"):
            redis_path = str(tmp / "redis.sock")
            procs.append(subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", redis_path,
                                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
            _wait_socket(redis_path, procs[-1])
        rows: list[dict] = []
        native: dict[str, tuple[str, subprocess.Popen]] = {}  # server -> (socket, process)
        if servers and native_echo.load() is None:
            rows += [row(f"{name} server", float("nan"), "us", note=f"unavailable: {native_echo.unavailable_reason()}")
                     for name in servers]
        else:
            for name in servers:
                path = str(tmp / f"{name}.sock")
                procs.append(_start_native(path, name))
                _wait_socket(path, procs[-1])
                native[name] = (path, procs[-1])

        daemon_pid = daemon.proc.pid if daemon is not None and daemon.proc is not None else None
        cpus = _client_cpus() if pin else None
        if cpus:  # servers on the first CPU, clients on the rest
            server_cpu = {min(os.sched_getaffinity(0))}
            for pid in [p.pid for p in procs] + ([daemon.proc.pid] if daemon is not None and daemon.proc else []):
                os.sched_setaffinity(pid, server_cpu)
        rng = np.random.default_rng(0)
        n_pages = prompt_tokens // LAYOUT.page_size
        payloads = {  # what each call carries, for echo and redis of the same size
            "match": {"engine": 1, "keys": bytes(16 * n_pages)},
            "insert": {"engine": 1, "keys": bytes(16 * n_pages), "tokens": bytes(4 * prompt_tokens),
                       "device_pages": bytes(4 * n_pages)},
        }
        for clients in client_counts:
            per = max(100, requests // clients)
            if "puts" in calls:
                rows += _puts_rows(daemon_path, prompt_tokens, max(20, per // (2 * STEP_PUTS)), clients, repeats,
                                   cpus, rng)
            for kind in [c for c in calls if c != "puts"]:
                size = len(pack_frame({"id": 1, "method": kind, "params": payloads[kind]}))
                hc, echo, red = [], [], []
                cpu_hc, cpu_echo, cpu_red = [], [], []  # servers' CPU seconds per round
                # echo servers with `servers`: latencies, CPU, latencies with the raw frame client
                nat: dict[str, tuple[list, list, list]] = {name: ([], [], []) for name in ["echo", *native]}
                # each echo server's clients' own CPU per call: [hicache client, raw client]
                own_cpu: dict[str, tuple[list, list]] = {name: ([], []) for name in ["echo", *native]}
                frame = pack_frame({"id": 1, "method": "echo", "params": payloads[kind]})
                for _ in range(repeats):  # the servers take turns: load swings hit all three alike
                    toks = [rng.integers(0, 1 << 30, prompt_tokens, dtype=np.int32) for _ in range(clients)]
                    lat, cpu = _timed_cpu(daemon_pid, lambda: _run_clients(
                        _hicache_client, lambda i: (daemon_path, kind, per, toks[i]), clients, cpus))
                    hc.append(lat)
                    cpu_hc.append(cpu)
                    lat, cpu = _timed_cpu(procs[0].pid, lambda: _run_clients(
                        _echo_client, lambda i: (echo_path, kind, payloads[kind], per), clients, cpus,
                        own_cpu["echo"][0]))
                    echo.append(lat)
                    cpu_echo.append(cpu)
                    if redis_path:
                        lat, cpu = _timed_cpu(procs[1].pid, lambda: _run_clients(
                            _redis_client, lambda i: (redis_path, size, per), clients, cpus))
                        red.append(lat)
                        cpu_red.append(cpu)
                    for name, (path, proc) in native.items():
                        lat, cpu = _timed_cpu(proc.pid, lambda: _run_clients(
                            _echo_client, lambda i: (path, kind, payloads[kind], per), clients, cpus,
                            own_cpu[name][0]))
                        nat[name][0].append(lat)
                        nat[name][1].append(cpu)
                    if native:  # each echo server again with a client as light as redis's
                        for name, path in [("echo", echo_path), *((n, p) for n, (p, _) in native.items())]:
                            nat[name][2].append(_run_clients(_frame_client, lambda i: (path, frame, per),
                                                             clients, cpus, own_cpu[name][1]))
                label = f"{kind} {prompt_tokens} tokens, {clients} client{'s' if clients > 1 else ''}"
                for q in (50, 99):
                    rows.append(row(f"{label} p{q}", _median_pcts(hc, q), "us", baseline=_median_pcts(echo, q),
                                    baseline_name="echo", repeats=repeats))
                if None not in cpu_hc + cpu_echo:
                    # What the server's process spends per iteration (a match's includes its
                    # release and the setup calls, a few in a thousand): the per-call CPU a native
                    # path would cut, steadier than latencies on a busy machine.
                    n_iter = clients * (per + 20)
                    rows.append(row(f"{label} daemon CPU per call{' + release' if kind == 'match' else ''}",
                                    float(np.median(cpu_hc)) / n_iter * 1e6, "us",
                                    baseline=float(np.median(cpu_echo)) / n_iter * 1e6,
                                    baseline_name="echo server CPU per call", repeats=repeats))
                    if cpu_red and None not in cpu_red:
                        rows.append(row(f"{label} daemon CPU per call{' + release' if kind == 'match' else ''}"
                                        f" vs redis GET {size}B", float(np.median(cpu_hc)) / n_iter * 1e6, "us",
                                        baseline=float(np.median(cpu_red)) / n_iter * 1e6,
                                        baseline_name="redis-server CPU per GET", repeats=repeats))
                if redis_path:
                    for q in (50, 99):
                        rows.append(row(f"{label} p{q} vs redis GET {size}B", _median_pcts(hc, q), "us",
                                        baseline=_median_pcts(red, q), baseline_name="redis", repeats=repeats))
                if native:
                    nat["echo"] = (echo, cpu_echo, nat["echo"][2])
                    rows += _echo_server_rows(label, nat, red, cpu_red,
                                              clients * (per + 20), repeats)
                    rows += [row(f"{label} {name} server, hicache client CPU per call", float(np.median(hc_cpu)) * 1e6,
                                 "us", baseline=float(np.median(raw_cpu)) * 1e6, baseline_name="raw client",
                                 repeats=repeats)
                             for name, (hc_cpu, raw_cpu) in own_cpu.items() if hc_cpu and raw_cpu]
        return rows
    finally:
        if daemon is not None:
            daemon.stop()
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
