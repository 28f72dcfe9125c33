"""Opening the disk tier at daemon start: a damaged environment (refused by the
tier's open protocol, or unreadable in the metadata scan) is moved aside once,
with one log line, and an empty tier opened in its place (see
hicache/tiers/disk_env.py); any other failure is the caller's one-line error."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lmdb

from hicache.config import Config
from hicache.errors import DiskTierDamaged, DiskTierError
from hicache.tiers import disk_env
from hicache.tiers.disk import DiskTier
from hicache.tiers.disk_config import DiskTierConfig
from hicache.tiers.disk_scan import MetaScan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Quarantine:
    """A damaged environment moved aside at this start."""

    path: str
    reason: str


def open_tier(config: Config) -> tuple[DiskTier, MetaScan, Quarantine | None]:
    """Open the tier and scan its metadata (every page's record, as arrays:
    hicache/tiers/disk_scan.py); a damaged environment (at open, or in the scan) is moved
    aside once, with one log line, and an empty one opened instead."""
    path = str(config.disk_dir)
    quarantined: Quarantine | None = None
    while True:
        try:
            # The capacity is the file: the map is allocated whole, and the pages with
            # their LMDB records are kept within it (hicache/tiers/disk_writer.py).
            tier = DiskTier.open(path, config.disk_capacity, map_size=config.disk_capacity,
                                 reset=config.reset_disk,
                                 durability=config.durability,
                                 config=DiskTierConfig(max_queue_pages=config.disk_queue_pages))
        except DiskTierDamaged as e:
            if quarantined is not None:
                raise
            quarantined = _move_aside(path, str(e))
            continue
        except DiskTierError as e:
            if quarantined is not None:  # the copy moved aside may be what fills the disk
                raise DiskTierError(f"{e} (the damaged environment moved aside to {quarantined.path} "
                                    "may be taking the space)") from e
            raise
        try:
            return tier, tier.scan_meta(), quarantined
        except lmdb.Error as e:  # the child's verification passed, yet a record cannot be read
            tier.close()
            if quarantined is not None:
                raise DiskTierError(f"{path}: a fresh environment cannot be read back: {e}") from e
            quarantined = _move_aside(path, f"{path}: damaged LMDB environment ({e})")


def _move_aside(path: str, reason: str) -> Quarantine:
    dest = disk_env.quarantine(path)
    log.error("disk tier: %s; moved aside to %s, starting with an empty disk tier", reason, dest)
    return Quarantine(dest, reason)
