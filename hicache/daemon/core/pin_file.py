"""The pins file: pinned prefixes kept across a daemon restart, next to the disk tier.

``pins.msgpack`` in the state directory holds one record per pin (namespace
salt, tier, the prefix's page keys, expiry in unix seconds, priority). It is
rewritten whole (temp file, fsync, rename) at most once a second while pins
change, and at shutdown; at startup, after the disk tier rebuilt the index,
the pins not expired are applied again (hicache/daemon/core/retention.py). A
pin made in the last second before a crash may be lost: a pin is a hint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgpack

log = logging.getLogger(__name__)

PINS_FILE = "pins.msgpack"


class PinFile:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / PINS_FILE
        self.fault = ""  # why the last write failed ("" when it did not)

    def load(self) -> list[dict]:
        """The records saved; none when the file is missing or unreadable (logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("%s is unreadable (%s); pins are not restored", self.path, e.strerror or e)
            return []
        try:
            records = msgpack.unpackb(data, raw=False)
        except Exception:
            log.warning("%s is damaged; pins are not restored", self.path)
            return []
        if not isinstance(records, list):
            log.warning("%s is not a pin list; pins are not restored", self.path)
            return []
        return [r for r in records if isinstance(r, dict)]

    def save(self, records: list[dict]) -> bool:
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(msgpack.packb(records, use_bin_type=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # ENOSPC, EROFS: pins still hold until this daemon stops
            tmp.unlink(missing_ok=True)
            if not self.fault:
                log.error("cannot save %s (%s): pins will not survive a restart until it succeeds",
                          self.path, e.strerror or e)
            self.fault = str(e.strerror or e)
            return False
        self.fault = ""
        return True
