"""Daemon configuration: embedded defaults < TOML file < HICACHE_* variables < flags.

`hicache serve` must start with no config file at all, so every field has a
default derived from the environment: the socket under `$XDG_RUNTIME_DIR`
(or a private 0700 directory under /tmp), state under `$STATE_DIRECTORY`
(systemd) or `$XDG_STATE_HOME/hicache`, and tier capacities sized from what
this machine has free.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.cpu_list import parse_cpu_list
from hicache.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

LOAD_POLICIES = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DURABILITY = ("none", "batch", "sync")
EVICTION_POLICIES = ("lru", "lfu", "frecency")  # hicache.index.policy.POLICIES
DISK_ADMISSION = ("all", "reuse")  # hicache.index.admission.ADMISSION_MODES
DISK_PLACEMENTS = ("inclusive", "non-inclusive", "exclusive")  # hicache/daemon/movers/disk_mover.py
# Page ids travel as int32; engines' pools are far smaller, and the daemon sizes work by them.
MAX_DEVICE_PAGES_LIMIT = 1 << 30
QUOTA_TIERS = ("host", "disk")  # tenant quotas (hicache/daemon/core/quotas.py): the daemon's own tiers
QUOTA_KEYS = ("model", "extra_key", "namespace", "tier", "min", "max")
SALT_HEX_CHARS = 32


def parse_size(value: str | int) -> int:
    """`512MiB`, `4GiB`, `1.5G`, `1048576` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (use e.g. 512MiB, 4GiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def private_socket_dir() -> Path:
    """The socket's directory when there is no runtime directory: `$TMPDIR/hicache-<uid>`.
    Any local user can create that name first, so the daemon serves there only when it is
    a real directory of its own with mode 0700 (hicache/daemon/serve/app.py)."""
    return Path(tempfile.gettempdir()) / f"hicache-{os.getuid()}"


def default_socket_path() -> Path:
    runtime = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime.split(":")[0]) / "hicache.sock"
    return private_socket_dir() / "hicache.sock"


SERVICE_SOCKET = Path("/run/hicache/hicache.sock")  # where systemd/hicache.socket listens


def admin_socket_path(explicit: str | None = None) -> str:
    """The socket admin commands talk to: --socket, HICACHE_SOCKET_PATH, this user's
    default, or the system service's when only that one exists."""
    if explicit:
        return explicit
    if os.environ.get("HICACHE_SOCKET_PATH"):
        return os.environ["HICACHE_SOCKET_PATH"]
    mine = default_socket_path()
    if not mine.exists() and SERVICE_SOCKET.exists():
        return str(SERVICE_SOCKET)
    return str(mine)


def default_state_dir() -> Path:
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "hicache"


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_host_capacity() -> int:
    """A quarter of available memory, between 64 MiB and 64 GiB: the engines need the rest."""
    return max(64 << 20, min(mem_available_bytes() // 4, 64 << 30))


DEFAULT_DISK_CAPACITY = 4 << 30
MIN_DISK_CAPACITY = 1 << 20  # an LMDB map smaller than this holds little beyond its own pages


def default_disk_capacity(state_dir: Path) -> int:
    """4 GiB or a tenth of the free space where state lives, whichever is smaller (at least
    64 MiB). The capacity is allocated on disk at start (the LMDB file, see
    hicache/daemon/movers/disk_startup.py), so a first run must not take a large share of a
    disk nobody sized for it: 4 GiB holds ~60,000 pages of 64 KiB, more than a single
    machine's engines reuse in the benches; a deployment sets --disk-capacity."""
    probe = state_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return max(64 << 20, min(free // 10, DEFAULT_DISK_CAPACITY))


@dataclass(frozen=True, slots=True)
class Share:
    """A part of a tier: bytes, or a fraction of its capacity (written `25%`)."""

    nbytes: int = 0
    fraction: float | None = None

    def of(self, capacity: int) -> int:
        return int(self.fraction * capacity) if self.fraction is not None else self.nbytes

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction is not None else format_size(self.nbytes)


def parse_share(value: str | int) -> Share:
    """`25%` (of the tier's capacity), or a size: `2GiB`, `1048576`."""
    if isinstance(value, float):  # 0.25 would read as 0 bytes
        raise ConfigError(f"not a share: {value!r} (write a share of the tier as '25%', or a size)")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"not a share: {value!r} (use e.g. 25% or 2GiB)") from None
        if not 0 <= pct <= 100:
            raise ConfigError(f"a share is between 0% and 100%, got {value!r}")
        return Share(fraction=pct / 100)
    return Share(nbytes=parse_size(value))


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One tenant's guaranteed minimum and maximum share of one tier.

    The tenant is every namespace of `model`, only those with extra key `extra_key`
    when it is given, or the one namespace whose salt is `namespace` (32 hex digits)."""

    tier: str
    min: Share = Share()
    max: Share | None = None  # None: the whole tier
    model: str = ""
    extra_key: str | None = None
    namespace: str = ""

    def __post_init__(self) -> None:
        if self.tier not in QUOTA_TIERS:
            raise ConfigError(f"quota tier must be one of {QUOTA_TIERS}, got {self.tier!r}")
        if bool(self.model) == bool(self.namespace):
            raise ConfigError("a quota names its tenant by model (and optionally extra_key) or by namespace "
                              "(a salt), not both and not neither")
        if self.extra_key is not None and not self.model:
            raise ConfigError("a quota's extra_key goes with its model")
        if self.namespace and (len(self.namespace) != SALT_HEX_CHARS
                               or any(c not in "0123456789abcdef" for c in self.namespace)):
            raise ConfigError(f"a quota's namespace is a salt of {SALT_HEX_CHARS} lowercase hex digits "
                              f"(as `hicache ls --json` shows), got {self.namespace!r}")

    @property
    def tenant(self) -> tuple[str, str | None, str]:
        return (self.model, self.extra_key, self.namespace)

    def describe(self) -> str:
        if self.namespace:
            return f"namespace={self.namespace[:16]}"
        return f"model={self.model}" + ("" if self.extra_key is None else f" extra_key={self.extra_key}")

    def bounds(self, capacity: int) -> tuple[int, int]:
        """(min, max) in bytes of a tier of `capacity` bytes; ConfigError when min > max."""
        lo = self.min.of(capacity)
        hi = capacity if self.max is None else self.max.of(capacity)
        if lo > hi:
            what = f"max {self.max}" if self.max is not None else f"the tier's {format_size(capacity)}"
            raise ConfigError(f"quota {self.describe()} on {self.tier}: min {self.min} is more than {what}")
        return lo, min(hi, capacity)


def parse_quota(value: str | dict) -> QuotaSpec:
    """A quota from a TOML table or a `key=value,...` string (the flag and HICACHE_QUOTAS):
    `model=llama,extra_key=tenant-a,tier=host,min=25%,max=50%`."""
    if isinstance(value, str):
        fields: dict[str, Any] = {}
        for item in value.split(","):
            key, eq, val = item.partition("=")
            if not eq:
                raise ConfigError(f"quota {value!r}: {item!r} is not key=value")
            fields[key.strip()] = val.strip()
    elif isinstance(value, dict):
        fields = dict(value)
    else:
        raise ConfigError(f"a quota is a table or a key=value,... string, got {value!r}")
    unknown = set(fields) - set(QUOTA_KEYS)
    if unknown:
        raise ConfigError(f"quota {value!r}: unknown keys {sorted(unknown)} (known: {', '.join(QUOTA_KEYS)})")
    if "tier" not in fields:
        raise ConfigError(f"quota {value!r}: no tier (host or disk)")
    for key in ("model", "extra_key", "namespace", "tier"):
        if key in fields and not isinstance(fields[key], str):
            raise ConfigError(f"quota {value!r}: {key} must be a string")
    return QuotaSpec(tier=fields["tier"], min=parse_share(fields.get("min", 0)),
                     max=parse_share(fields["max"]) if fields.get("max") not in (None, "") else None,
                     model=fields.get("model", ""), extra_key=fields.get("extra_key"),
                     namespace=fields.get("namespace", "").lower())


def check_quotas(quotas: tuple[QuotaSpec, ...], capacities: dict[str, int | None]) -> None:
    """ConfigError unless every quota's min <= max and, per tier, the mins add up to at most its
    capacity, one quota per tenant and tier, and the tier exists (`None`: disabled)."""
    seen: set[tuple] = set()
    mins = dict.fromkeys(capacities, 0)
    for q in quotas:
        cap = capacities.get(q.tier)
        if cap is None:
            raise ConfigError(f"quota {q.describe()} on {q.tier}: this daemon has no {q.tier} tier")
        if (q.tenant, q.tier) in seen:
            raise ConfigError(f"two quotas for {q.describe()} on {q.tier}")
        seen.add((q.tenant, q.tier))
        mins[q.tier] += q.bounds(cap)[0]
    for tier, total in mins.items():
        cap = capacities[tier]
        if cap is not None and total > cap:
            raise ConfigError(f"the {tier} quotas' minimums add up to {format_size(total)}, more than the "
                              f"{tier} tier's {format_size(cap)}")


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
