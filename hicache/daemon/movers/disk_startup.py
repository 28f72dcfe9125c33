"""Opening the disk tier at daemon start: a damaged environment (refused by the
tier's open protocol, or unreadable in the metadata scan) is moved aside once,
with one log line, and an empty tier opened in its place (see
hicache/tiers/disk/env.py); any other failure is the caller's one-line error.

The index rebuild is prepared here too (`open_and_chain`): every page's record scanned
(hicache/tiers/disk/scan.py: by the verification child, which hands its scan over),
each known namespace's records checked and chained into runs (hicache/index/restore.py,
in C) and, given the daemon's eviction policy and clock, hung on a new index of the
namespace that nothing else can see yet; DiskMover's rebuild on the event loop adopts
those indexes. `DiskOpening` does it all on a thread of its own, started before the
host arena is allocated: the arena's mlock, the child, and the chaining wait on the
kernel or run in C without the GIL, so on two cores most of it overlaps (at a million
pages ~1 s of work, ~0.5 s of it beside the arena's)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from hicache.config import Config
from hicache.daemon.movers.disk_namespaces import NAMESPACES_FILE, NamespaceFile
from hicache.daemon.movers.state_dir import prepare_state_dir
from hicache.errors import DiskTierDamaged, DiskTierError
from hicache.index.keys import Namespace
from hicache.index.policy import EvictionPolicy
from hicache.index.radix import RadixIndex
from hicache.index.restore import ChainedRecords, PackedRecords, chain_packed
from hicache.tiers.disk import env as disk_env
from hicache.tiers.disk.config import DiskTierConfig
from hicache.tiers.disk.scan import MetaScan
from hicache.tiers.disk.tier import DiskTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Quarantine:
    """A damaged environment moved aside at this start."""

    path: str
    reason: str


def open_tier(config: Config) -> tuple[DiskTier, MetaScan, Quarantine | None]:
    """Open the tier and scan its metadata (every page's record, as arrays:
    hicache/tiers/disk/scan.py); a damaged environment (at open, or in the scan) is moved
    aside once, with one log line, and an empty one opened instead."""
    path = str(config.disk_dir)
    quarantined: Quarantine | None = None
    while True:
        try:
            # The capacity is the file: the map is allocated whole, and the pages with
            # their LMDB records are kept within it (hicache/tiers/disk/writer.py).
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


@dataclass(slots=True)
class SaltRecords:
    """The scanned records of one salt: a known namespace's, checked and chained (`chained`,
    or `records` where the index's C module is not built), with the keys of its records
    of another page size (`malformed`), and when an index could be built here that index
    (`restored` pages, the keys left out in `malformed` too); an unknown salt's only as
    rows of the scan."""

    salt: bytes
    rows: np.ndarray | slice
    namespace: Namespace | None = None
    chained: ChainedRecords | None = None
    records: PackedRecords | None = None  # until chained (kept where the C is not built)
    malformed: list[bytes] = field(default_factory=list)
    index: RadixIndex | None = None
    restored: int = 0


@dataclass(slots=True)
class OpenedDisk:
    tier: DiskTier
    scan: MetaScan
    quarantine: Quarantine | None
    namespaces: NamespaceFile
    salts: list[SaltRecords]
    open_s: float  # opening and scanning
    chain_s: float  # checking and chaining the records (and hanging them on new indexes)


def open_and_scan(config: Config) -> OpenedDisk:
    """The state directory prepared, the tier opened and its records scanned and grouped by
    namespace (module docstring): the rebuild's first half. Runs on any thread."""
    t0 = time.monotonic()
    prepare_state_dir(Path(config.state_dir))
    tier, scan, quarantined = open_tier(config)
    try:
        if config.reset_disk:
            (Path(config.state_dir) / NAMESPACES_FILE).unlink(missing_ok=True)
        names = NamespaceFile(config.state_dir)
        salts = []
        for salt, rows in scan.by_salt().items():
            namespace = names.namespace(salt)
            if namespace is None:
                salts.append(SaltRecords(salt, rows))
                continue
            ps = namespace.layout.page_size
            rows, malformed = scan.rows_with(rows, ps)  # a page of another size is no page of this namespace
            records = PackedRecords(scan.keys[rows], scan.parents[rows], scan.token_rows(rows, ps),
                                    scan.last_access[rows])
            salts.append(SaltRecords(salt, rows, namespace, None, records, scan.key_list(malformed)))
    except BaseException:
        tier.close()
        raise
    return OpenedDisk(tier, scan, quarantined, names, salts, time.monotonic() - t0, 0.0)


def chain_all(opened: OpenedDisk, clock: Callable[[], float] | None = None,
              policy: EvictionPolicy | None = None) -> None:
    """The rebuild's second half for each known namespace: its records checked and chained
    (in C; where that is not built they stay `records`) and, given the daemon's `clock` and
    `policy`, hung on a new index. Touches no index anyone else holds: runs on any thread."""
    t0 = time.monotonic()
    for group in opened.salts:
        if group.namespace is None or group.records is None:
            continue
        ps = group.namespace.layout.page_size
        group.chained = chain_packed(group.records, group.salt, ps)
        if group.chained is not None:
            group.records = None
        if clock is not None and policy is not None:
            group.index = RadixIndex(ps, group.salt, policy, clock)
            group.restored = group.index.restore_packed(group.chained or group.records, group.malformed)
    opened.chain_s = time.monotonic() - t0


def open_and_chain(config: Config, clock: Callable[[], float] | None = None,
                   policy: EvictionPolicy | None = None) -> OpenedDisk:
    """open_and_scan, then chain_all."""
    opened = open_and_scan(config)
    try:
        chain_all(opened, clock, policy)
    except BaseException:
        opened.tier.close()
        raise
    return opened


class DiskOpening:
    """The rebuild's halves on a thread of its own (module docstring): `opened()` joins the
    first; then, for a tier of at most `restore_sync_pages` pages, the second builds the
    indexes too (`chained()` joins it), for a bigger one it only chains (`lazy`: the daemon
    answers at once and hangs the runs meanwhile, hicache/daemon/movers/disk_restore.py)."""

    def __init__(self, config: Config, clock: Callable[[], float] | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        self._opened: Future[OpenedDisk] = Future()
        self.chained: Future[OpenedDisk] = Future()
        self.lazy = False
        self._thread = threading.Thread(target=self._run, args=(config, clock, policy), name="hicache-disk-open",
                                        daemon=True)
        self._thread.start()

    def _run(self, config: Config, clock: Callable[[], float] | None, policy: EvictionPolicy | None) -> None:
        try:
            opened = open_and_scan(config)
        except BaseException as e:  # raised again by opened(), on the caller's thread
            self._opened.set_exception(e)
            return
        self.lazy = len(opened.scan) > config.restore_sync_pages
        self._opened.set_result(opened)
        try:
            if self.lazy:
                chain_all(opened)
            else:
                chain_all(opened, clock, policy)
        except BaseException as e:
            self.chained.set_exception(e)
            return
        self.chained.set_result(opened)

    def opened(self) -> OpenedDisk:
        return self._opened.result()

    def abandon(self) -> None:
        """The daemon's start failed before the disk tier started: close what was opened."""
        self._thread.join()
        if self._opened.done() and self._opened.exception() is None:
            self._opened.result().tier.close()
