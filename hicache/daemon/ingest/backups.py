"""The engine cycle's backups through the ingest protocol: device pages copied to host.

Under write-through `insert` plans a backup of the pages it recorded; under
write-back `evict` plans one of the victims that lack a host copy. Either way
the engine copies whole nodes from its device pages into host pages reserved
here (protocol.py), with the device copies DEVICE-locked as the anchor, and
reports `backup_done`: the host pages are set on the nodes they were planned
for. Nodes may have been split since planning; they still tile the planned
page ranges of the path, so the pages are placed by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.daemon.core.records import EngineRecord, path_with_offsets
from hicache.daemon.ingest.protocol import Ingest, Reservation
from hicache.index.node import Tier, TreeNode


@dataclass(slots=True, eq=False)
class BackupPart:
    last_node: TreeNode  # DEVICE-locked until done: keeps the path and the source pages alive
    ranges: list[tuple[int, int]]  # page ranges of the root->last_node path being backed up


@dataclass(slots=True, eq=False)
class PendingBackup:
    res: Reservation  # its host pages are in the order of parts and ranges
    parts: list[BackupPart]
    device_pages: np.ndarray
    evict_after: bool  # write-back: drop E's device residency once the copy is done

    @property
    def backup_id(self) -> int:
        return self.res.res_id

    @property
    def engine(self) -> EngineRecord:
        return self.res.engine

    @property
    def host_pages(self) -> np.ndarray:
        return self.res.host_pages


def plan_backup(ingest: Ingest, rec: EngineRecord, parts: list[tuple[TreeNode, list[tuple[TreeNode, int]]]],
                evict_after: bool) -> PendingBackup | None:
    """Reserve host pages for whole nodes, their device copies locked until backup_done;
    None when there is nothing to copy or no room.

    parts: (node to lock, [(node to copy, its page position), ...]) per path.
    """
    parts = [(last, need) for last, need in parts if need]
    if not parts:
        return None
    n_pages = sum(n.n_pages for _, need in parts for n, _ in need)
    res = ingest.reserve("backup", rec.ns, n_pages, engine=rec,
                         anchor=lambda: [(last, Tier.DEVICE, rec.engine_id) for last, _ in parts])
    if res is None:
        return None
    backup = PendingBackup(
        res, [BackupPart(last, [(p, p + n.n_pages) for n, p in need]) for last, need in parts],
        np.concatenate([n.device[rec.engine_id] for _, need in parts for n, _ in need]), evict_after)
    res.data = backup
    return backup


def place_backup(res: Reservation) -> tuple[list[TreeNode], list[np.ndarray]]:
    """Set each planned node's host copy (its DEVICE lock still held); a node that got a
    host copy meanwhile (a put, a prefetch) leaves ours unused."""
    backup: PendingBackup = res.data
    index = res.ns.index
    offset = 0
    stored: list[TreeNode] = []
    unused: list[np.ndarray] = []
    for part in backup.parts:
        by_pos = {p: n for n, p in path_with_offsets(part.last_node)}
        for start, end in part.ranges:
            pages = res.host_pages[offset:offset + end - start]
            offset += end - start
            pos = start
            while pos < end:
                node = by_pos[pos]
                piece = pages[pos - start:pos - start + node.n_pages]
                if node.host is None:
                    index.set_host(node, piece.copy())
                    stored.append(node)
                else:
                    unused.append(piece)
                pos += node.n_pages
    return stored, unused
