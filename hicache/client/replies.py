"""What the daemon's answers become on the engine side: the match of a prefix, and the
plans (backup, put, state backup) the engine carries out and then reports done
(hicache/client/reports.py). Each carries the client's `epoch` it was made in: a plan
of an earlier epoch is void (the daemon that issued its ids is gone)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class BackupPlan:
    backup_id: int
    host_pages: np.ndarray
    device_pages: np.ndarray
    epoch: int


@dataclass(slots=True)
class StateMatch:
    """Hybrid models: what the request may restore. Lengths are in tokens."""

    kv_len: int             # the KV match, before the daemon cut it at the checkpoint
    length: int             # the usable prefix: the checkpoint's position (0: start from scratch)
    host_slot: int | None   # the checkpoint's host state slot (byte offset = slot * checkpoint_bytes)
    fork_at: int | None     # the request leaves the tree inside a node here: checkpoint it on the way

    @classmethod
    def parse(cls, d: dict) -> StateMatch:
        return cls(int(d["kv_len"]), int(d["len"]), None if d["slot"] is None else int(d["slot"]),
                   None if d["fork_at"] is None else int(d["fork_at"]))


@dataclass(slots=True)
class StateBackupPlan:
    """Copy device state slot i into host state slot i, then report state_backup_done."""

    backup_id: int
    host_slots: list[int]
    device_slots: list[int]
    positions: list[int]
    epoch: int


@dataclass(slots=True)
class Match:
    """What the daemon holds for a prefix. Lengths are in pages."""

    pin: int | None  # None: a miss answered locally (daemon away)
    keys: list[bytes]
    device_pages: np.ndarray  # this engine's pages that already hold the prefix
    host_pages: np.ndarray  # host pages holding the next part
    disk_len: int  # pages on disk not brought to host in time (per the daemon's load policy)
    epoch: int
    from_disk: int = 0  # of host_pages, how many the daemon just read from disk
    state: StateMatch | None = None  # hybrid namespaces only
    pending: bool = False  # a lookup beyond disk_len still runs (the remote store): `load` says what it found

    @property
    def device_len(self) -> int:
        return len(self.device_pages)

    @property
    def host_len(self) -> int:
        return len(self.host_pages)


@dataclass(slots=True)
class PutPlan:
    """Copy page `present + i` of the stored prefix into host slot `host_pages[i]`, then
    report `put_done` (from any engine of the namespace). `put` None: nothing to copy."""

    put: int | None
    present: int  # leading pages the host tier already holds
    host_pages: np.ndarray
    slabs: int  # the namespace's slab version the host pages need mapped
    epoch: int


class Late:
    """A waited call whose answer had not come by its deadline, and whose caller takes the
    answer when it comes (HiCacheClient.insert's `on_late`)."""

    def __repr__(self) -> str:
        return "LATE"


LATE = Late()


@dataclass(slots=True)
class InsertReply:
    present_pages: int
    free_pages: np.ndarray  # duplicates: the engine frees these device pages now
    backup: BackupPlan | None
    state_backup: StateBackupPlan | None = None  # hybrid namespaces: checkpoints to copy to host
