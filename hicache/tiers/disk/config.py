"""DiskTierConfig: the disk tier's tuning knobs, shared by hicache/tiers/disk/tier.py
and its writer (hicache/tiers/disk/writer.py) so that imports flow one way:
disk -> disk_writer -> disk_config."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.errors import ConfigError

__all__ = ["DiskTierConfig"]

CHECKSUM_NAMES = ("xxh3", "auto", "sum64", "crc32")


@dataclass(frozen=True)
class DiskTierConfig:
    """Tuning knobs; the defaults are the measured ones."""

    readers: int = 2  # reader threads behind get_many_async
    max_queue_pages: int = 1024  # queued puts before put_async returns False
    max_queue_bytes: int = 512 << 20
    # One write transaction takes at most this much. Big batches matter for small
    # pages: every begin/commit drops the GIL and may wait up to the switch
    # interval to get it back from a busy event loop.
    batch_pages: int = 256
    batch_bytes: int = 64 << 20
    touch_interval_s: float = 30.0  # last_access updates are flushed this often
    max_pending_touches: int = 1 << 20
    # New records carry XXH3-64 (format.py). The older names "auto",
    # "sum64" and "crc32" are still accepted and mean "xxh3" too (it is faster
    # than either at every page size and catches more): configs that name them
    # keep working; records written under them stay readable.
    checksum: str = "xxh3"
    # False skips the read-side checksum pass (for storage that checksums
    # itself, e.g. ZFS/btrfs); corrupt pages are then served, not dropped.
    verify_reads: bool = True
    # After a batch fails with an I/O (or any non-budget) error even op by op,
    # puts are refused this long before the writer tries the disk again.
    write_retry_s: float = 30.0
    # Runs of puts are written by a C loop with the GIL released (native.py)
    # where it can be built; False keeps the Python loop (the same writes, slower).
    native_writer: bool = True

    def __post_init__(self) -> None:
        for name in ("readers", "max_queue_pages", "max_queue_bytes", "batch_pages", "batch_bytes",
                     "max_pending_touches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DiskTierConfig.{name} must be >= 1")
        for name in ("touch_interval_s", "write_retry_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"DiskTierConfig.{name} must be > 0")
        if self.checksum not in CHECKSUM_NAMES:
            raise ConfigError(f"DiskTierConfig.checksum must be 'xxh3' (the old names {CHECKSUM_NAMES[1:]} "
                              f"are accepted and mean the same), got {self.checksum!r}")
