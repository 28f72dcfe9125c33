"""When device pages are backed up to the host tier.

- write_through (default): right after the pages are inserted.
- write_through_selective: once a page run has been hit `hit_threshold` times,
  so one-off prefixes never cost host memory or copy bandwidth.
- write_back: only when the device evicts the pages, before their slots are freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hicache.errors import ConfigError


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @classmethod
    def parse(cls, value: str | WritePolicy) -> WritePolicy:
        """From a config string (case and `-`/`_` insensitive); ConfigError names the choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for policy in cls:
                if policy.value == key:
                    return policy
        choices = ", ".join(p.value for p in cls)
        raise ConfigError(f"write policy must be one of {choices}; got {value!r}")


@dataclass(frozen=True, slots=True)
class BackupPolicy:
    policy: WritePolicy = WritePolicy.WRITE_THROUGH
    hit_threshold: int = 2  # write_through_selective: back up at this many hits

    def __post_init__(self) -> None:
        if not isinstance(self.policy, WritePolicy):
            raise ConfigError(f"policy must be a WritePolicy, got {self.policy!r}")
        if not isinstance(self.hit_threshold, int) or isinstance(self.hit_threshold, bool) \
                or self.hit_threshold < 1:
            raise ConfigError(f"hit_threshold must be an int >= 1, got {self.hit_threshold!r}")

    def should_backup_on_insert(self, hit_count: int) -> bool:
        """Back up pages now, as they are inserted or hit (`hit_count` hits so far)?"""
        if self.policy is WritePolicy.WRITE_THROUGH:
            return True
        if self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            return hit_count >= self.hit_threshold
        return False

    def should_backup_on_evict(self) -> bool:
        """Must a device eviction copy pages out first? Only under write_back; the
        write-through policies already copied what they keep."""
        return self.policy is WritePolicy.WRITE_BACK
