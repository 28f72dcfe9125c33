"""The engine's reports to the daemon: what it did with a match or a plan (loaded,
released, put, backed up, state backed up) and the prefill rate it measured.

Most may be posted (`wait=False`): sent without waiting for the answer, in order
with the calls after them (HiCacheClient._post). A report of an earlier epoch is
void: the daemon that issued its ids is gone, so nothing is sent.

ReportCalls is mixed into HiCacheClient (hicache/client/client.py), whose `_report`
sends each one, through the circuit breaker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hicache.client.prefill_rate import PrefillRate
from hicache.client.replies import EMPTY, BackupPlan, Match, PutPlan, StateBackupPlan
from hicache.rpc.framing import bytes_to_ids, ids_to_bytes


class ReportCalls:
    """HiCacheClient's reports (see the module docstring)."""

    if TYPE_CHECKING:  # HiCacheClient's
        engine_id: int | None
        epoch: int
        prefill_rate: PrefillRate
        connected: bool

        def _report(self, method: str, params: dict, *, wait: bool = True) -> dict | None: ...
        def _post_many(self, calls: list[tuple[str, dict]]) -> bool: ...

    def load_done(self, match: Match, device_pages: np.ndarray, *, wait: bool = True) -> np.ndarray | None:
        """Report the host part copied into `device_pages`. Returns pages to free, or
        None when the daemon no longer tracks this match (the caller keeps the pages private).

        `wait=False` sends it without waiting (see `_post`) and returns no pages: pages the
        engine turns out to hold twice (another request of it loaded the same part meanwhile)
        are handed back by its next `evict` instead. The pin keeps its host pages locked until
        the daemon handles the report, which comes before any later call of this connection."""
        if match.pin is None or match.epoch != self.epoch:
            return None
        params = {"pin": match.pin, "device_pages": ids_to_bytes(device_pages)}
        if not wait:
            params["reclaim"] = True
        r = self._report("load_done", params, wait=wait)
        if r is None:
            return None
        return bytes_to_ids(r["free_pages"]) if wait else EMPTY

    def release(self, match: Match, *, wait: bool = True) -> None:
        """Unpin `match`. `wait=False` sends it without waiting for the answer (see `_post`)."""
        if match.pin is None or match.epoch != self.epoch:
            return
        self._report("release", {"pin": match.pin}, wait=wait)

    def put_done(self, plan: PutPlan, ok: bool = True, *, wait: bool = True) -> int | None:
        """The copies of `plan` are in place (or failed: `ok` False). Returns the pages the
        host tier gained, None when the daemon is not reachable (the put then expires) or
        with `wait=False`, which sends it without waiting for the answer (see `_post`)."""
        if plan.put is None or plan.epoch != self.epoch:
            return None
        params = {"engine": self.engine_id, "put": plan.put, "ok": ok}
        r = self._report("put_done", params, wait=wait)
        return None if r is None or not wait else int(r["added"])

    def put_dones(self, items: list[tuple[PutPlan, bool]]) -> None:
        """`put_done` of several plans (plan, ok), posted in one write (see `_post`)."""
        calls = [("put_done", {"engine": self.engine_id, "put": plan.put, "ok": ok}) for plan, ok in items
                 if plan.put is not None and plan.epoch == self.epoch]
        if calls:
            self._post_many(calls)

    def releases(self, matches: list[Match]) -> None:
        """`release` of several matches, posted in one write (see `_post`)."""
        calls = [("release", {"pin": m.pin}) for m in matches if m.pin is not None and m.epoch == self.epoch]
        if calls:
            self._post_many(calls)

    def state_backup_done(self, plan: StateBackupPlan, ok: bool = True) -> int | None:
        """The checkpoints of `plan` are copied into their host slots (or failed: `ok`
        False). Returns how many the daemon stored, None when it is not reachable."""
        if plan.epoch != self.epoch:
            return None
        r = self._report("state_backup_done", {"backup": plan.backup_id, "ok": ok})
        return None if r is None else int(r["stored"])

    def backup_done(self, plan: BackupPlan, ok: bool = True, *, wait: bool = True) -> np.ndarray | None:
        """The copies of `plan` are in place (or failed). Returns device pages the engine may
        free now (a write-back eviction's), None when the daemon is not reachable.
        `wait=False` (for insert's plans, which free nothing) sends it without waiting (see
        `_post`) and returns no pages; the daemon keeps the host pages reserved until it
        handles it, before any later call of this connection."""
        if plan.epoch != self.epoch:
            return None
        r = self._report("backup_done", {"backup": plan.backup_id, "ok": ok}, wait=wait)
        if r is None:
            return None
        return bytes_to_ids(r["free_pages"]) if wait else EMPTY

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` prompt tokens in `seconds` of model time; the daemon
        hears the rate when it moved (a posted `report`: no round trip). Ignored with a
        configured rate."""
        self.prefill_rate.add(tokens, seconds)
        rate = self.prefill_rate.to_report()
        if rate is not None and self.connected:
            self._report("report", {"engine": self.engine_id, "prefill_tokens_per_s": rate}, wait=False)
            self.prefill_rate.sent(rate)
