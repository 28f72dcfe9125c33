"""The disk tier's namespaces file: what a namespace is (model, layout, TP rank, ...)
for pages found on disk at startup.

A page record carries only its namespace's salt (a hash), so the rebuild needs
each namespace's descriptor to hang its pages on a tree again. The file is
written, and fsynced, before a namespace's first page is queued (`remember`);
pages of a salt it does not name are dropped at the rebuild. A write that fails
(ENOSPC, EROFS, EIO) degrades the disk tier for namespaces first seen from then
on (`fault` says why) until a later write succeeds; the daemon keeps serving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgpack

from hicache.daemon.core.service import NamespaceState
from hicache.index.keys import Namespace
from hicache.layout import KVLayout
from hicache.state_layout import StateLayout

log = logging.getLogger(__name__)

NAMESPACES_FILE = "namespaces.msgpack"


class NamespaceFile:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / NAMESPACES_FILE
        self.known: dict[bytes, dict] = self._read()  # salt -> descriptor
        self.fault = ""  # why the last write failed ("" when it did not)
        self.faults = 0

    def _read(self) -> dict[bytes, dict]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warning("%s is unreadable (%s); disk pages of unknown namespaces will be dropped", self.path, e)
            return {}
        try:
            table = msgpack.unpackb(data, raw=False)
            return {bytes.fromhex(k): v for k, v in table.items()}
        except Exception:
            log.warning("%s is unreadable; disk pages of unknown namespaces will be dropped", self.path)
            return {}

    def namespace(self, salt: bytes) -> Namespace | None:
        """The namespace the file names for `salt` (None: unknown, or a descriptor that
        no longer hashes to it)."""
        desc = self.known.get(salt)
        if desc is None:
            return None
        state = StateLayout.from_dict(desc["state"]) if desc.get("state") else None
        namespace = Namespace(desc["model"], KVLayout.from_dict(desc["layout"]), desc["tp_rank"],
                              desc["tp_size"], desc["extra_key"], state)
        return namespace if namespace.salt() == salt else None

    def remember(self, ns: NamespaceState) -> bool:
        """Save the namespace's descriptor (before any of its pages is queued: the
        rebuild needs it); False, with the tier degraded, when it cannot be saved."""
        if ns.salt in self.known:
            return True
        n = ns.namespace
        desc = {"model": n.model, "layout": n.layout.to_dict(), "tp_rank": n.tp_rank, "tp_size": n.tp_size,
                "extra_key": n.extra_key, "state": n.state.to_dict() if n.state is not None else None}
        table = {**self.known, ns.salt: desc}
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(msgpack.packb({k.hex(): v for k, v in table.items()}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # ENOSPC, EROFS, EIO: keep serving; this namespace's pages stay off disk
            tmp.unlink(missing_ok=True)
            if not self.fault:
                self.faults += 1
                log.error("disk tier degraded: cannot save %s (%s); pages of namespaces first seen from now "
                          "on are not written to disk until it succeeds", self.path, e.strerror or e)
            self.fault = f"cannot save {self.path.name}: {e.strerror or e}"
            return False
        self.known = table
        if self.fault:
            log.warning("disk tier: %s saved again; the degrade is over", self.path.name)
            self.fault = ""
        return True
