"""The daemon's lifecycle: startup -> serve -> shutdown, on uvloop when installed.

Startup brings the tiers up (host arena, then the disk tier and its index
rebuild), then binds the socket (or adopts one from systemd), and only then
reports READY. SIGTERM / SIGINT stop accepting, answer what is in flight,
flush the disk queue and exit 0.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# np.unique (slab ids of a store, of freed pages) imports numpy.ma on its first call: ~20 ms,
# which an engine's first store waited for. Imported at start-up instead.
import numpy.ma  # noqa: F401

from hicache import __version__
from hicache.config import Config, format_size, private_socket_dir
from hicache.daemon.serve import native_paths
from hicache.daemon.serve.gc_steward import GcSteward
from hicache.daemon.serve.handlers import ADMIN_METHODS, build_handlers
from hicache.daemon.serve.placement import pin_to_cpus
from hicache.daemon.core.fetch_or_recompute import FETCH_TIERS, FetchOrRecompute
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.pin_file import PinFile
from hicache.daemon.core.retention import Retention
from hicache.daemon.hybrid.states import HybridStates
from hicache.daemon.ingest.puts import HostPuts
from hicache.daemon.core.quotas import TenantQuotas
from hicache.daemon.core.service import CacheService
from hicache.errors import HiCacheError
from hicache.index import native_index
from hicache.index.admission import AdmissionConfig, DiskAdmission, admission_capacity_pages
from hicache.index.policy import make_policy
from hicache.index.radix import Tier
from hicache.rpc.connection import Connection
from hicache.rpc.server import RpcServer
from hicache.systemd.activation import listen_fds_with_names
from hicache.systemd.sdnotify import Notifier, watchdog_loop
from hicache.transfer.policy import WritePolicy

log = logging.getLogger(__name__)

# The longest a stop waits for the disk writes accepted before it (the unit's TimeoutStopSec
# is 120 s); what is still waiting then goes with the host arena, as at a kill
SHUTDOWN_SETTLE_S = 60.0


def prepare_socket_path(path: Path) -> None:
    """Create the socket's directory (private when we create it), check that no other user
    can swap the socket in it, and clear a stale socket."""
    parent = path.parent
    private = parent == private_socket_dir()
    try:
        parent.mkdir(mode=0o700, parents=not private)
    except FileExistsError:
        pass  # checked below, never trusted for existing
    check_socket_dir(parent, private)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise HiCacheError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink()  # a stale socket from a daemon that died
        else:
            raise HiCacheError(f"another daemon is already serving on {path}")
        finally:
            probe.close()


def check_socket_dir(parent: Path, private: bool) -> None:
    """`lstat` the socket's directory: never a symlink (its owner chose where we bind); the
    default one under the temp dir exactly ours with mode 0700 (anyone may create that name
    first); any other ours or root's, and not writable by others unless sticky."""
    try:
        st = parent.lstat()
    except OSError as e:
        raise HiCacheError(f"socket directory {parent}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise HiCacheError(f"socket directory {parent} is a symbolic link, refusing to bind through it: remove it "
                           "or use --socket in a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise HiCacheError(f"socket directory {parent} is not a directory")
    uid, mode = os.getuid(), stat.S_IMODE(st.st_mode)
    if private:
        if st.st_uid != uid:
            raise HiCacheError(f"socket directory {parent} belongs to uid {st.st_uid}, not to us (uid {uid}): "
                               f"another user may have created it to catch engines; rm -r {parent} as root, or "
                               "set XDG_RUNTIME_DIR or --socket")
        if mode != 0o700:
            raise HiCacheError(f"socket directory {parent} has mode {mode:04o}, expected 0700: chmod 700 {parent}")
        return
    if st.st_uid not in (uid, 0):
        raise HiCacheError(f"socket directory {parent} belongs to uid {st.st_uid}, not to us")
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise HiCacheError(f"socket directory {parent} is writable by other users (mode {mode:04o}), who could "
                           f"replace the socket: chmod go-w {parent}")


def index_clock(kind: str) -> Callable[[], float]:
    """The index's access times (Config.index_clock): wall seconds, which disk records keep
    across restarts, or one tick per call, which makes a replay evict deterministically."""
    if kind == "wall":
        return time.time
    ticks = itertools.count(1)
    return lambda: float(next(ticks))


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.host: HostTier | None = None
        self.service: CacheService | None = None
        self.server: RpcServer | None = None
        self.disk: Any = None  # DiskMover once the disk tier is up
        self.remote: Any = None  # RemoteMover with --remote-url
        self.hybrid: HybridStates | None = None  # state checkpoints of hybrid models
        self.puts: HostPuts | None = None  # host-direct stores of engines with their own device cache
        self.retention: Retention | None = None  # pinned prefixes (hicache/index/pins.py)
        self.instance = os.urandom(8).hex()  # tells engines a restarted daemon (a new arena) from this one
        self._stop: asyncio.Event | None = None
        self._bound_path: Path | None = None
        self.notifier: Notifier | None = None
        self.metrics: Any = None
        self._metrics_http: Any = None
        self._background: set[asyncio.Task] = set()
        self.gc: GcSteward | None = None

    # -- lifecycle -----------------------------------------------------------
    async def run(self) -> int:
        self._stop = asyncio.Event()
        await self.startup()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()
        return 0

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def startup(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.notifier = Notifier.from_env()
        # The socket first: a directory another user could swap, or a daemon already
        # serving there, is refused before the arena is allocated and the disk rebuilt.
        inherited = listen_fds_with_names()
        if not inherited:
            prepare_socket_path(cfg.socket_path)
        remote_store, remote_auth = None, None
        if cfg.remote_url:  # a bad password or secret file is refused before anything is allocated or opened
            from hicache.tiers.remote.auth import RecordAuth
            from hicache.tiers.remote.store import open_store

            remote_store = open_store(cfg.remote_url, password_file=cfg.remote_password_file,
                                      timeout_s=cfg.remote_timeout_s)
            remote_auth = RecordAuth.from_file(cfg.remote_secret_file) if cfg.remote_secret_file else None
        # The disk tier opens, scans and checks its records on a thread meanwhile: the arena's
        # mlock and those wait on the kernel or run in C (hicache/daemon/movers/disk_startup.py).
        clock, policy = index_clock(cfg.index_clock), make_policy(cfg.eviction_policy)  # the restored indexes' too
        opening = self._open_disk(clock, policy) if cfg.disk_enabled else None
        try:
            self.host = HostTier(cfg.host_capacity, mlock=cfg.mlock)
        except BaseException:
            if opening is not None:
                opening.abandon()
            raise
        native_index.load()  # the index's C loops: loaded now, not in a first request
        log.info("host tier: %s arena (%s slabs of %s), mlock=%s", format_size(self.host.capacity_bytes),
                 self.host.num_slabs, format_size(self.host.slab_bytes), self.host.arena.locked)
        self.service = CacheService(self.host, write_policy=WritePolicy(cfg.write_policy),
                                    write_hit_threshold=cfg.write_hit_threshold, emit=self._emit,
                                    clock=clock,
                                    max_device_pages=cfg.max_device_pages,
                                    eviction_policy=policy)
        self.service.fetch_cost = FetchOrRecompute(enabled=cfg.fetch_or_recompute,
                                                   context_tokens=cfg.recompute_context_tokens,
                                                   remeasure_s=cfg.fetch_remeasure_s)
        self.puts = HostPuts(self.service, lease_s=cfg.put_lease_s)
        # checked again against the arena as built (slabs round its size down); before the
        # disk tier, whose mover reports its writes in flight to the quotas
        self.service.quotas = TenantQuotas(self.service, {
            "host": self.host.capacity_bytes, "disk": cfg.disk_capacity if cfg.disk_enabled else None})
        self.service.quotas.replace_all(cfg.quotas)
        if cfg.disk_enabled or cfg.remote_url:  # the tiers below the host take what it expects back
            disk_bytes = cfg.disk_capacity if cfg.disk_enabled else 0
            pages = admission_capacity_pages(self.host.capacity_bytes + disk_bytes)
            self.service.admission = DiskAdmission(AdmissionConfig(mode=cfg.disk_admission), pages)
        # before the disk tier: its rebuild hands state checkpoint records to HybridStates
        self.hybrid = HybridStates(self.service, disk_capacity=cfg.disk_capacity if cfg.disk_enabled else 0,
                                   load_policy=cfg.load_policy, prefetch_timeout_s=cfg.prefetch_timeout_s)
        if cfg.disk_enabled:
            # The capacity is what the disk tier takes: its LMDB file, allocated whole at start.
            log.info("disk tier: %s at %s (the LMDB file, allocated up front; --disk-capacity to change, "
                     "--no-disk for none)", format_size(cfg.disk_capacity), cfg.disk_dir)
            self._start_disk(opening)
        else:
            log.info("disk tier: off")
        self.hybrid.attach_disk(self.disk.tier if self.disk is not None else None, loop)
        # after the disk rebuild: the pins saved next to it are applied to the restored index
        self.retention = Retention(self.service, host_capacity=self.host.capacity_bytes,
                                   disk_capacity=cfg.disk_capacity if self.disk is not None else 0,
                                   max_share=cfg.pin_max_share, max_ttl_s=cfg.pin_max_ttl_s,
                                   pin_file=PinFile(cfg.state_dir) if self.disk is not None else None,
                                   within_quota=self._pins_within_quota,
                                   priority_max_share=cfg.priority_max_share, priority_ttl_s=cfg.priority_ttl_s)
        if self.disk is not None:
            self.retention.write_pinned = self.disk.write_pinned
            self.disk.when_restored(self.retention.restore)  # on the whole index
        if remote_store is not None:
            from hicache.daemon.movers.remote_mover import RemoteMover  # the remote tier is optional

            # after the disk tier: chains behind it
            self.remote = RemoteMover.start(cfg, self.service, remote_store, remote_auth)
            if self.disk is not None:  # pages only on disk are offered to the store too
                from hicache.daemon.movers.remote_publish import RemotePublisher

                self.remote.publisher = RemotePublisher(self.remote, self.service, self.disk.tier,
                                                        cfg.remote_publish_pages, cfg.remote_queue_pages)
                self.remote.publisher.start()
        allowed_uids = set(cfg.allowed_uids) or {os.getuid(), 0}
        self.server = RpcServer(build_handlers(self), max_frame_bytes=cfg.max_frame_bytes,
                                max_buffer_bytes=cfg.max_buffer_bytes, max_inflight=cfg.max_inflight,
                                allowed_uids=allowed_uids, allowed_gids=set(cfg.allowed_gids),
                                on_disconnect=self._on_disconnect, admin_uids={0, os.getuid()},
                                admin_gids=set(cfg.admin_gids), admin_methods=ADMIN_METHODS,
                                max_total_buffer_bytes=cfg.max_total_buffer_bytes,
                                max_output_bytes=cfg.max_output_bytes,
                                max_event_backlog_bytes=cfg.max_event_backlog_bytes)
        if inherited:
            # systemd socket activation: prefer the fd named "rpc", else the first one
            name, sock = next(((n, s) for n, s in inherited if n == "rpc"), inherited[0])
            for _, other in inherited:
                if other is not sock:
                    other.close()
            await self.server.start(sock=sock)
            log.info("serving on the socket passed by the service manager (%s)", name)
        else:
            await self.server.start(path=str(cfg.socket_path))
            self._bound_path = cfg.socket_path
            log.info("serving on %s", cfg.socket_path)
        if cfg.metrics_port:
            from hicache.daemon.serve.metrics import TIERS, Metrics

            self.metrics = Metrics(tiers=(*TIERS, "remote") if self.remote is not None else TIERS)
            self._metrics_http = self.metrics.start_http(cfg.metrics_port)
            self.server.observe = self.metrics.observe_rpc
            self._spawn(self._refresh_metrics())
            log.info("metrics on %s", self._metrics_http.url)
        self._spawn(self.puts.sweep(min(1.0, cfg.put_lease_s / 4)))
        self._spawn(self.retention.sweep())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        if self.notifier.watchdog_interval_s:
            self._spawn(watchdog_loop(self.notifier, self.notifier.watchdog_interval_s))
        if cfg.managed_gc:  # last: the start-up heap (a rebuilt index) is frozen at once
            server = self.server
            self.gc = GcSteward(lambda: server.counters.requests)
            self.gc.start()
            self._spawn(self.gc.run())
        self.notifier.ready(f"serving; host {format_size(self.host.capacity_bytes)}")


    def _pins_within_quota(self, salt: bytes, tier: Tier) -> bool:
        """The pins' question to the tenant quotas: a namespace over its maximum share of a
        tier has its pins there given up, lowest priority first (hicache/index/pins.py)."""
        ns = self.service.namespaces.get(salt)
        quotas = self.service.quotas
        return ns is None or quotas is None or quotas.within_quota(ns, tier)
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_metrics(self) -> None:
        """Gauges and counters are sampled once a second from the daemon's own counters,
        rather than updated per request on the hot path."""
        last: dict[str, int] = {}

        def delta(key: str, now: int) -> int:
            d = now - last.get(key, 0)
            last[key] = now
            return max(0, d)

        m = self.metrics
        while True:
            st = self.stats()
            c = self.service.counters
            for name, t in st["tiers"].items():
                m.set_tier(name, t.get("capacity_bytes", 0), t.get("used_bytes", 0), t.get("pages", 0))
            for tier in ("device", "host", "disk"):
                m.add_hits(tier, delta(f"hit.{tier}", c.matched_pages[tier]))
                m.add_evictions(tier, delta(f"evict.{tier}", c.evicted_pages[tier]))
            m.add_misses(delta("miss", c.requested_pages - sum(c.matched_pages[t] for t in ("device", "host", "disk"))))
            m.add_bytes_moved("host", "device", delta("h2d", c.bytes_host_to_device))
            m.add_bytes_moved("device", "host", delta("d2h", c.bytes_device_to_host))
            if self.disk is not None:
                disk = self.disk.tier.stats()
                m.add_bytes_moved("host", "disk", delta("h2s", disk["bytes_written"]))
                m.add_bytes_moved("disk", "host", delta("s2h", disk["bytes_read"]))
                for op, seconds in self.disk.take_latencies():
                    m.observe_disk(op, seconds)
                dst = st["tiers"]["disk"]
                for fault in ("quarantined", "corrupt_pages", "write_faults", "orphans_dropped", "rejected_orphan"):
                    m.add_disk_faults(fault, delta(f"fault.{fault}", dst[fault]))
                m.set_disk_degraded(not dst["writable"])
            if self.remote is not None:
                r = st["tiers"]["remote"]
                m.add_hits("remote", delta("hit.remote", r["hit_pages"]))
                m.add_bytes_moved("host", "remote", delta("h2r", r["bytes_written"]))
                m.add_bytes_moved("remote", "host", delta("r2h", r["bytes_read"]))
                for what in ("written_pages", "miss_pages", "dropped_pages", "failed_writes", "corrupt_records",
                             "errors"):
                    m.add_remote(what, delta(f"remote.{what}", r[what]))
                for op, seconds in self.remote.take_latencies():
                    m.observe_remote(op, seconds)
                m.set_remote_up(r["available"], r["kind"])
                m.set_queue_depth("remote_write", r["queue_pages"])
            skipped = st["fetch_or_recompute"]["skipped_pages"]
            for tier in FETCH_TIERS:
                m.add_recomputed(tier, delta(f"recompute.{tier}", skipped[tier]))
            m.set_engines(len(st["engines"]))
            m.set_native({path: entry["runs"] for path, entry in st["native"].items()})
            m.set_namespaces(self._namespace_usage())
            m.add_dropped_subscribers(delta("dropped_subscribers", st["events"]["dropped_subscribers"]))
            for reason in ("output_overflows", "input_overflows"):
                m.add_dropped_connections(reason, delta(reason, st["rpc"][reason]))
            if self.disk is not None:
                self.metrics.set_queue_depth("disk_write", st["tiers"]["disk"].get("queue_depth", 0))
                self.metrics.set_queue_depth("disk_backlog", st["tiers"]["disk"].get("backlog_pages", 0))
            await asyncio.sleep(1.0)

    def _namespace_usage(self) -> list[tuple[str, str, dict[str, tuple[int, int]]]]:
        """(salt hex, model, {tier: (pages, bytes)}) per namespace, for the per-namespace gauges."""
        out = []
        for ns in list(self.service.namespaces.values()):
            page_bytes = ns.namespace.layout.page_bytes
            tiers = {}
            for name, tier in (("device", Tier.DEVICE), ("host", Tier.HOST), ("disk", Tier.DISK)):
                pages = ns.index.num_pages(tier)
                tiers[name] = (pages, pages * page_bytes)
            out.append((ns.salt.hex(), ns.namespace.model, tiers))
        return out

    def _open_disk(self, clock: Callable[[], float], policy: Any) -> Any:
        from hicache.daemon.movers.disk_startup import DiskOpening  # the disk tier is optional

        return DiskOpening(self.config, clock, policy)

    def _start_disk(self, opening: Any) -> None:
        from hicache.daemon.movers.disk_mover import DiskMover

        try:
            self.disk = DiskMover.start(self.config, self.service, opening)
        except HiCacheError as e:  # read-only, full, not ours: one line, not a traceback
            raise HiCacheError(f"the disk tier cannot start: {e}; fix the state directory "
                               f"({self.config.state_dir}) or run with --no-disk") from e

    async def shutdown(self) -> None:
        log.info("shutting down: draining requests")
        if self.notifier is not None:
            self.notifier.stopping("draining requests")
        for task in list(self._background):
            task.cancel()
        if self._metrics_http is not None:
            self._metrics_http.close()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if self.server is not None:
            await self.server.drain(self.config.drain_timeout_s)
        if self.retention is not None:
            self.retention.save()
        if self.remote is not None:  # queued remote writes are best effort: not waited for
            await asyncio.to_thread(self.remote.close)
        if self.disk is not None:
            if self.notifier is not None:
                self.notifier.status("flushing the disk tier")
            # the write-through backlog first: it reaches the tier's queue only from this loop
            if not await self.disk.settle(SHUTDOWN_SETTLE_S):
                log.warning("shutting down with %d disk writes still pending after %.0fs",
                            len(self.disk.writes), SHUTDOWN_SETTLE_S)
            await asyncio.to_thread(self.disk.close)
        if self._bound_path is not None:
            try:
                self._bound_path.unlink()
            except FileNotFoundError:
                pass
        if self.host is not None:
            self.host.close()
        if self.gc is not None:
            self.gc.stop()
        log.info("stopped")

    # -- callbacks ---------------------------------------------------------
    def _on_disconnect(self, conn: Connection) -> None:
        if self.service is not None:
            self.service.disconnect(conn)

    def _emit(self, event: dict) -> None:
        if self.server is not None:
            self.server.broadcast_event(event, event.get("namespace"))

    # -- introspection -------------------------------------------------------
    def stats(self) -> dict:
        svc, host = self.service, self.host
        assert svc is not None and host is not None
        c = svc.counters
        requested = max(1, c.requested_pages)
        tiers: dict[str, Any] = {
            "host": {"capacity_bytes": host.capacity_bytes, "used_bytes": host.used_bytes,
                     "pages": sum(cls.used_pages for cls in host.classes.values()),
                     "hit_rate": c.matched_pages["host"] / requested,
                     "evicted_pages": c.evicted_pages["host"], "locked": host.arena.locked,
                     "spare_slabs": host.spare_slabs},
            "device": {"pages": sum(ns.index.num_pages(Tier.DEVICE) for ns in svc.namespaces.values()),
                       "hit_rate": c.matched_pages["device"] / requested,
                       "evicted_pages": c.evicted_pages["device"]},
        }
        if self.disk is not None:
            tiers["disk"] = self.disk.stats()
            tiers["disk"]["hit_rate"] = c.matched_pages["disk"] / requested
        if self.remote is not None:
            tiers["remote"] = self.remote.stats()
            tiers["remote"]["hit_rate"] = tiers["remote"]["hit_pages"] / requested
        engines = [{"engine": r.engine_id, "model": r.ns.namespace.model, "tp_rank": r.ns.namespace.tp_rank,
                    "device_pages": r.device_pages,
                    "resident_pages": r.ns.index.num_pages(Tier.DEVICE, r.engine_id),
                    "pid": getattr(getattr(r.owner, "peer", None), "pid", None)} for r in svc.engines.values()]
        return {"version": __version__, "pid": os.getpid(), "uptime_s": time.time() - self.started_at,
                "write_policy": svc.write_policy.value,
                "eviction_policy": svc.eviction_policy.name, "tiers": tiers, "engines": engines,
                "namespaces": len(svc.namespaces), "pins": len(svc.pins), "pending_backups": len(svc.backups),
                "pinned": self.retention.stats() if self.retention is not None else None,
                "priorities": self.retention.priority_stats() if self.retention is not None else None,
                "requests": {"matches": c.matches, "requested_pages": c.requested_pages,
                             "inserts": c.inserts, "inserted_pages": c.inserted_pages,
                             "loaded_pages": c.loaded_pages, "backups": c.backups_planned,
                             "backup_pages": c.backup_pages, "backups_skipped_no_space": c.backups_skipped_no_space},
                "puts": asdict(self.puts.counters) | {"pending": len(self.puts.puts)} if self.puts else None,
                "connections": len(self.server.connections) if self.server else 0,
                "states": self.hybrid.stats() if self.hybrid is not None else None,
                "quotas": svc.quotas.stats() if svc.quotas is not None and svc.quotas.active else None,
                "fetch_or_recompute": svc.fetch_cost.stats(list(svc.engines.values()))
                if svc.fetch_cost is not None else None,
                "gc": self.gc.stats() if self.gc is not None else {"managed": False},
                "native": native_paths.report(self.server.frame_loop if self.server else "", self.disk is not None),
                **self._rpc_stats()}

    def _rpc_stats(self) -> dict:
        server = self.server
        if server is None:
            return {"events": {"subscribers": 0, "dropped_subscribers": 0},
                    "rpc": {"frame_loop": "", "buffered_input_bytes": 0, "output_overflows": 0,
                            "input_overflows": 0, "requests": 0, "fast_requests": 0}}
        c = server.counters
        return {"events": {"subscribers": sum(conn.subscribed for conn in server.connections),
                           "dropped_subscribers": c.dropped_subscribers},
                "rpc": {"frame_loop": server.frame_loop, "buffered_input_bytes": server.buffered_bytes,
                        "output_overflows": c.output_overflows,
                        "input_overflows": c.input_overflows, "requests": c.requests,
                        "fast_requests": c.fast_requests}}


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM / SIGINT; uvloop when installed."""
    # Before anything is created: the state directory, LMDB's files and the namespaces
    # file hold every tenant's KV (their prompts), so they are the daemon's alone. The
    # socket sets its own mode (0660; peers are checked by credentials).
    os.umask(0o077)
    pin_to_cpus(config)  # first: every thread started from here on inherits the CPUs
    daemon = Daemon(config)
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(daemon.run())
