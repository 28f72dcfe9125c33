"""Daemon configuration: embedded defaults < TOML file < HICACHE_* variables < flags.

settings.py (Config: every setting, its default and its check; load_config: the merge),
defaults.py (what is derived from this machine: the socket and state paths, the tiers'
capacities), quota_specs.py (tenant quotas as configured: QuotaSpec, shares of a tier, their
checks) and sizes.py (`512MiB` <-> bytes). Every name is imported from here:
`from hicache.config import Config, parse_size`.
"""

from hicache.config.defaults import (
    DEFAULT_DISK_CAPACITY, MIN_DISK_CAPACITY, SERVICE_SOCKET, admin_socket_path, default_disk_capacity,
    default_host_capacity, default_socket_path, default_state_dir, mem_available_bytes, private_socket_dir,
)
from hicache.config.quota_specs import (
    QUOTA_KEYS, QUOTA_TIERS, SALT_HEX_CHARS, QuotaSpec, Share, check_quotas, parse_quota, parse_share,
)
from hicache.config.settings import (
    DISK_ADMISSION, DISK_PLACEMENTS, DURABILITY, EVICTION_POLICIES, LOAD_POLICIES, MAX_DEVICE_PAGES_LIMIT,
    REMOVED_SETTINGS, WRITE_POLICIES, Config, load_config,
)
from hicache.config.sizes import format_size, parse_size

__all__ = [
    "DEFAULT_DISK_CAPACITY", "DISK_ADMISSION", "DISK_PLACEMENTS", "DURABILITY", "EVICTION_POLICIES",
    "LOAD_POLICIES", "MAX_DEVICE_PAGES_LIMIT", "MIN_DISK_CAPACITY", "QUOTA_KEYS", "QUOTA_TIERS",
    "REMOVED_SETTINGS", "SALT_HEX_CHARS", "SERVICE_SOCKET", "WRITE_POLICIES", "Config", "QuotaSpec", "Share",
    "admin_socket_path", "check_quotas", "default_disk_capacity", "default_host_capacity",
    "default_socket_path", "default_state_dir", "format_size", "load_config", "mem_available_bytes",
    "parse_quota", "parse_share", "parse_size", "private_socket_dir",
]
