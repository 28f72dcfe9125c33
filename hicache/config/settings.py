"""Config: every setting of the daemon, its default and its check; load_config merges
embedded defaults < TOML file < HICACHE_* variables < flags into one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.config.defaults import (
    MIN_DISK_CAPACITY, default_disk_capacity, default_host_capacity, default_socket_path, default_state_dir,
)
from hicache.config.quota_specs import QuotaSpec, check_quotas, parse_quota
from hicache.config.sizes import format_size, parse_size
from hicache.cpu_list import parse_cpu_list
from hicache.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef]

LOAD_POLICIES = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DURABILITY = ("none", "batch", "sync")
EVICTION_POLICIES = ("lru", "lfu", "frecency")  # hicache.index.policy.POLICIES
DISK_ADMISSION = ("all", "reuse")  # hicache.index.admission.ADMISSION_MODES
DISK_PLACEMENTS = ("inclusive", "non-inclusive", "exclusive")  # hicache/daemon/movers/disk_mover.py
# Page ids travel as int32; engines' pools are far smaller, and the daemon sizes work by them.
MAX_DEVICE_PAGES_LIMIT = 1 << 30


@dataclass(frozen=True)
class Config:
    socket_path: Path = field(default_factory=default_socket_path)
    state_dir: Path = field(default_factory=default_state_dir)
    host_capacity: int = 0  # bytes; 0 = derive from available memory
    disk_capacity: int = 0  # bytes; 0 = derive from free disk space
    disk_enabled: bool = True
    reset_disk: bool = False
    durability: str = "none"  # see hicache/tiers/disk/tier.py for the measured trade-off
    write_policy: str = "write_through"
    write_hit_threshold: int = 2  # write_through_selective: back up after this many hits
    load_policy: str = "best_effort"
    eviction_policy: str = "frecency"  # lru | lfu | frecency (hicache/index/policy.py)
    # Which host pages are written to disk (hicache/index/admission.py): "reuse" writes a page
    # only while the disk has room or when it is expected back; "all" writes every one.
    disk_admission: str = "reuse"
    # "inclusive": written through as they reach the host (they survive a restart);
    # "non-inclusive": written only as the host evicts them (more distinct pages, fewer writes);
    # "exclusive": that, and a page read back from disk leaves it (the most distinct pages)
    disk_placement: str = "inclusive"
    # "wall": access times in unix seconds (disk records keep them across restarts);
    # "logical": one tick per index operation, so a replay evicts the same pages every
    # time (benches comparing policies; disk access times are then not comparable
    # across restarts)
    index_clock: str = "wall"
    prefetch_timeout_s: float = 0.05
    # A match stops before a disk or remote part the engine computes faster than the tier reads
    # it (hicache/daemon/core/fetch_or_recompute.py; needs the engine's prefill rate). false:
    # every cached page is loaded.
    fetch_or_recompute: bool = True
    recompute_context_tokens: int = 32768  # context at which attention costs as much as the rest (0: flat)
    fetch_remeasure_s: float = 30.0  # a tier last measured longer ago is read anyway, to measure it again
    put_lease_s: float = 60.0  # a host put (puts.py) nobody finishes is dropped after this long
    # Pinned prefixes (hicache/index/pins.py): the share of a tier's capacity one namespace
    # may keep pinned there, and the longest a pin may last
    pin_max_share: float = 0.25
    pin_max_ttl_s: float = 86400.0
    # Prefix priorities (hicache/index/priorities.py): the share of the host tier's capacity one
    # namespace's positively prioritized pages may cover, and how long a priority given without
    # a TTL lasts (each hint renews it; any TTL is at most pin_max_ttl_s)
    priority_max_share: float = 0.25
    priority_ttl_s: float = 600.0
    disk_queue_pages: int = 1024  # queued disk writes before write-through skips (counted)
    restore_sync_pages: int = 200_000  # more disk pages at a restart: it answers first, indexes them meanwhile
    allowed_uids: tuple[int, ...] = ()  # empty = the daemon's uid and root
    allowed_gids: tuple[int, ...] = ()
    admin_gids: tuple[int, ...] = ()  # besides root and the daemon's uid: who may flush, import, export...
    max_frame_bytes: int = 64 << 20
    max_buffer_bytes: int = 128 << 20  # unparsed input per connection; over it the connection is closed
    max_total_buffer_bytes: int = 512 << 20  # the same, summed over connections; the largest goes first
    max_output_bytes: int = 128 << 20  # unsent output per connection; over it the connection is aborted
    max_event_backlog_bytes: int = 8 << 20  # a subscriber with more unsent output is dropped
    max_inflight: int = 256  # concurrent requests per connection before BUSY
    max_device_pages: int = 1 << 24  # per engine; page ids travel as int32
    max_request_pages: int = 1 << 20  # keys in one match / insert
    drain_timeout_s: float = 10.0
    # The daemon runs the cyclic garbage collector itself so that no pass walks the whole
    # index while a request waits (hicache/daemon/serve/gc_steward.py); false: CPython's defaults
    managed_gc: bool = True
    metrics_port: int = 0  # 0 = no metrics endpoint
    # Remote tier (L4, hicache/daemon/movers/remote_mover.py): off without a URL. The URL may
    # carry a password: never in repr() (so never in a log of the config).
    remote_url: str = field(default="", repr=False)
    remote_password_file: str = ""  # wins over a password in the URL
    # every remote operation, a match's probe included (a match never waits for it: the
    # engine asks again), fetches, writes, health checks
    remote_timeout_s: float = 1.0
    remote_ttl_s: float = 86400.0  # records expire a day after their last write (0: never)
    remote_queue_pages: int = 1024  # pages being written; beyond it write-through drops (counted)
    remote_negative_ttl_s: float = 1.0  # how long a continuation the store lacked is not probed again
    remote_write_hold_s: float = 5.0  # a write waits this long for a store that failed, then drops (counted)
    remote_secret_file: str = ""  # the cluster secret(s) records are signed with; none: unauthenticated
    remote_publish_pages: int = 4096  # disk-only pages offered to the store each time it comes up (0: none)
    # Tenant quotas (hicache/daemon/core/quotas.py): a minimum and maximum share of host and disk
    # per model, model and extra key, or namespace; `hicache quota` changes them at run time.
    quotas: tuple[QuotaSpec, ...] = ()
    # "reuse": once the store is full, only pages expected back are written (remote_admission.py);
    # "all": every one
    remote_admission: str = "reuse"
    mlock: bool = True
    # The CPUs the daemon and its threads run on (hicache/daemon/serve/placement.py); empty: the
    # ones it was started with. Off the cores an engine's forward pass is bound to.
    cpus: tuple[int, ...] = ()
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(f"load_policy must be one of {LOAD_POLICIES}, got {self.load_policy!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.disk_admission not in DISK_ADMISSION:
            raise ConfigError(f"disk_admission must be one of {DISK_ADMISSION}, got {self.disk_admission!r}")
        if self.disk_placement not in DISK_PLACEMENTS:
            raise ConfigError(f"disk_placement must be one of {DISK_PLACEMENTS}, got {self.disk_placement!r}")
        if self.index_clock not in ("wall", "logical"):
            raise ConfigError(f"index_clock must be 'wall' or 'logical', got {self.index_clock!r}")
        if self.durability not in DURABILITY:
            raise ConfigError(f"durability must be one of {DURABILITY}, got {self.durability!r}")
        for name in ("max_frame_bytes", "max_buffer_bytes", "max_inflight", "disk_queue_pages",
                     "write_hit_threshold", "max_total_buffer_bytes", "max_output_bytes",
                     "max_event_backlog_bytes", "max_device_pages", "max_request_pages", "put_lease_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.max_total_buffer_bytes < self.max_buffer_bytes:
            raise ConfigError("max_total_buffer_bytes must be >= max_buffer_bytes")
        if self.max_device_pages > MAX_DEVICE_PAGES_LIMIT:
            raise ConfigError(f"max_device_pages must be <= {MAX_DEVICE_PAGES_LIMIT} (page ids travel as int32)")
        if self.remote_url:
            from hicache.tiers.remote.store import backend_for  # errors name only the redacted URL

            backend_for(self.remote_url)
        if not 0 < self.remote_timeout_s <= 60:
            raise ConfigError("remote_timeout_s must be in (0, 60]")
        if self.remote_ttl_s < 0 or self.remote_negative_ttl_s < 0 or self.remote_queue_pages <= 0:
            raise ConfigError("remote_ttl_s and remote_negative_ttl_s must be >= 0, remote_queue_pages > 0")
        if self.remote_admission not in DISK_ADMISSION:
            raise ConfigError(f"remote_admission must be one of {DISK_ADMISSION}, got {self.remote_admission!r}")
        if self.remote_publish_pages < 0 or self.restore_sync_pages < 0:
            raise ConfigError("remote_publish_pages and restore_sync_pages must be >= 0")
        if not 0 <= self.pin_max_share <= 1 or not self.pin_max_ttl_s > 0:
            raise ConfigError("pin_max_share must be in [0, 1] and pin_max_ttl_s > 0")
        if not 0 <= self.priority_max_share <= 1 or not 0 < self.priority_ttl_s <= self.pin_max_ttl_s:
            raise ConfigError("priority_max_share must be in [0, 1] and priority_ttl_s in (0, pin_max_ttl_s]")
        if not 0 <= self.remote_write_hold_s <= 600:
            raise ConfigError("remote_write_hold_s must be in [0, 600]")
        if self.recompute_context_tokens < 0 or not 0 < self.fetch_remeasure_s <= 86400:
            raise ConfigError("recompute_context_tokens must be >= 0 and fetch_remeasure_s in (0, 86400]")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError("metrics_port must be in 0..65535")
        if self.host_capacity == 0:
            object.__setattr__(self, "host_capacity", default_host_capacity())
        if self.disk_capacity == 0:
            object.__setattr__(self, "disk_capacity", default_disk_capacity(self.state_dir))
        elif self.disk_enabled and self.disk_capacity < MIN_DISK_CAPACITY:
            raise ConfigError(f"disk_capacity must be >= {format_size(MIN_DISK_CAPACITY)} (it is the LMDB file's "
                              f"size), got {self.disk_capacity} bytes; use --no-disk for no disk tier")
        check_quotas(self.quotas, {"host": self.host_capacity,
                                   "disk": self.disk_capacity if self.disk_enabled else None})

    @property
    def disk_dir(self) -> Path:
        return self.state_dir / "disk"


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Settings that went, and what replaced them: a file, variable or flag that still sets one
# is refused with this (an unknown HICACHE_* variable would otherwise pass unnoticed).
REMOVED_SETTINGS = {
    "remote_lookup_timeout_s": "a match no longer waits for the remote store: it answers at once, with "
                               "`pending` while its probe runs, and the engine asks again (`load`); the probe "
                               "is bounded by remote_timeout_s like every remote operation. Drop the setting",
}
_SIZE_FIELDS = {"host_capacity", "disk_capacity", "max_frame_bytes", "max_buffer_bytes", "max_total_buffer_bytes",
                "max_output_bytes", "max_event_backlog_bytes"}


def _coerce(name: str, value: Any) -> Any:
    if name in REMOVED_SETTINGS:
        raise ConfigError(f"setting {name!r} was removed: {REMOVED_SETTINGS[name]}")
    if name not in _FIELDS:
        raise ConfigError(f"unknown setting {name!r}")
    kind = _FIELDS[name].type
    if name == "cpus":  # "0-3,8", or TOML's [0, 1]
        try:
            cpus = parse_cpu_list(value) if isinstance(value, str) else {int(c) for c in value}
        except (TypeError, ValueError) as e:
            raise ConfigError(f"cpus: {e}" if isinstance(value, str) else f"cpus: not a CPU list: {value!r}") from e
        return tuple(sorted(cpus))
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)
        if name in ("socket_path", "state_dir"):
            return Path(os.path.expanduser(str(value)))
        if name == "quotas":  # TOML: an array of tables; a flag or variable: specs separated by ";"
            items = [x for x in value.split(";") if x.strip()] if isinstance(value, str) else list(value)
            return tuple(parse_quota(x) for x in items)
        if name in ("allowed_uids", "allowed_gids", "admin_gids"):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(_principal(name, str(x).strip()) for x in items if str(x).strip() != "")
        if kind == "bool":
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as e:
        shown = "<redacted>" if name == "remote_url" else repr(value)
        raise ConfigError(f"bad value for {name}: {shown}") from e


def _principal(name: str, item: str) -> int:
    """A uid / gid given as a number or as a user / group name."""
    if item.isdigit():
        return int(item)
    import grp
    import pwd

    try:
        return pwd.getpwnam(item).pw_uid if name == "allowed_uids" else grp.getgrnam(item).gr_gid
    except KeyError:
        raise ConfigError(f"{name}: no such {'user' if name == 'allowed_uids' else 'group'} {item!r}") from None


def load_config(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> Config:
    """Merge defaults, the TOML file, HICACHE_* variables and explicit overrides (flags)."""
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {config_file}: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {config_file} is not valid TOML: {e}") from e
        section = data.get("hicache", data)
        for k, v in section.items():
            values[k.replace("-", "_")] = _coerce(k.replace("-", "_"), v)
    env = os.environ if environ is None else environ
    for k, v in env.items():
        if k.startswith("HICACHE_") and k != "HICACHE_CONFIG":
            name = k[len("HICACHE_"):].lower()
            if name in _FIELDS or name in REMOVED_SETTINGS:
                values[name] = _coerce(name, v)
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = _coerce(k, v)
    return Config(**values)
