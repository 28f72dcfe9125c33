"""Rebuilding the disk part of a namespace's tree after a restart: per-page records ->
checked runs -> nodes (RadixIndex.restore_disk and restore_packed call these).

A record is (key, parent key or the salt, tokens, last access). One is kept only if its
key is the hash of (parent key, tokens) -- or of (salt, tokens): a keyed engine's named
page (hicache.client.keyed), whose name in its tokens already commits to its whole
prefix and which the daemon chained by position -- and its parents reach the salt
through kept records: LMDB's records are the truth, checked page by page, never trusted
as a whole. A chain of pages with one child each becomes one run, one node.

Two ways in, one result:
- `disk_runs` over records in any iterable (tuples or DiskRecord): Python, per record;
- `chain_packed` over `PackedRecords` (arrays, as the disk tier's scan returns them:
  hicache/tiers/disk/scan.py): the check and the chaining in C (native_restore.c, the
  hashing on every core), ~0.4 s per million records against ~8 s in Python, then
  `restore_packed` hangs the runs; where the index's C module is not built, the same
  records go through `disk_runs`. tests/index/test_restore_packed.py compares the two on
  random record sets with orphans, corrupt and duplicate records.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import numpy as np

from hicache.index import native_index
from hicache.index.keys import KEY_BYTES, PackedKeys, as_tokens, key_run
from hicache.index.node import DISK_LANE, DiskRecord, TreeNode

RadixIndex = Any  # hicache/index/radix.py's, which imports this module (its restore methods call these)

log = logging.getLogger(__name__)

_KEY = np.dtype(f"V{KEY_BYTES}")  # a page key as one numpy item: .tolist() gives bytes


@dataclass(slots=True)
class PackedRecords:
    """Page records of one namespace as arrays, record i in row i of each."""

    keys: np.ndarray  # (n, 16) uint8: page keys
    parents: np.ndarray  # (n, 16) uint8: the parent page's key, or the salt for a first page
    tokens: np.ndarray  # (n, page_size) little-endian int32
    last_access: np.ndarray  # (n,) float64

    def __len__(self) -> int:
        return len(self.keys)

    def key_list(self, rows: np.ndarray | None = None) -> list[bytes]:
        keys = self.keys if rows is None else self.keys[rows]
        return np.ascontiguousarray(keys).view(_KEY).reshape(-1).tolist()

    def tuples(self) -> list[tuple[bytes, bytes, np.ndarray, float]]:
        """The records as restore_disk takes them (the Python path)."""
        return list(zip(self.key_list(), np.ascontiguousarray(self.parents).view(_KEY).reshape(-1).tolist(),
                        self.tokens, self.last_access.tolist()))


@dataclass(slots=True)
class DiskRun:
    """Consecutive verified pages of one branch, to hang below the page `parent_key`."""

    parent_key: bytes
    keys: list[bytes]
    tokens: np.ndarray
    last_access: float  # the newest of its pages


_LE_I4 = np.dtype("<i4")


def disk_runs(records: object, salt: bytes, page_size: int) -> tuple[list[DiskRun], list[bytes]]:
    """Check per-page disk records (any order) and chain them into runs, each run's
    parent page in an earlier run (or the salt). A record is kept only if its key is
    the hash of (parent key, tokens) -- or of (salt, tokens): a keyed engine's named
    page (hicache.client.keyed), whose name in its tokens already commits to its whole
    prefix and which the daemon chained by position -- and its parents reach the salt.
    Returns the runs
    and the keys of the records left out (orphans, corrupt, malformed), which the
    caller may delete from disk."""
    by_parent: dict[bytes, list[tuple[bytes, np.ndarray, float]]] = {}
    seen: set[bytes] = set()
    skipped: list[bytes] = []
    for rec in records:
        try:
            key, parent_key, tokens, last_access = rec
            if type(key) is not bytes or len(key) != KEY_BYTES:
                continue  # no usable key to report
            # disk records already hold little-endian int32 arrays: skip the conversion
            toks = tokens if type(tokens) is np.ndarray and tokens.dtype == _LE_I4 and tokens.ndim == 1 \
                and tokens.flags.c_contiguous else as_tokens(tokens)
            la = float(last_access)
        except (TypeError, ValueError, OverflowError):
            continue
        if type(parent_key) is not bytes or len(parent_key) != KEY_BYTES or len(toks) != page_size:
            skipped.append(key)
        elif key not in seen:
            seen.add(key)
            by_parent.setdefault(parent_key, []).append((key, toks, la))
    runs: list[DiskRun] = []
    kept: set[bytes] = set()
    stack = [salt]
    while stack:
        parent_key = stack.pop()
        for item in by_parent.pop(parent_key, ()):
            keys: list[bytes] = []
            toks_list: list[np.ndarray] = []
            newest = float("-inf")
            prev = parent_key
            while True:  # a single-child chain becomes one run
                key, toks, la = item
                data = toks.tobytes()  # page_keys' chain step, or a named page's
                if blake2b(prev + data, digest_size=KEY_BYTES).digest() != key \
                        and blake2b(salt + data, digest_size=KEY_BYTES).digest() != key:
                    skipped.append(key)  # corrupt: it and its descendants stay out
                    break
                keys.append(key)
                toks_list.append(toks)
                newest = max(newest, la)
                prev = key
                nxt = by_parent.get(key)
                if nxt is None or len(nxt) != 1:
                    break
                del by_parent[key]
                item = nxt[0]
            if keys:
                runs.append(DiskRun(parent_key, keys, np.concatenate(toks_list), newest))
                kept.update(keys)
                stack.append(prev)
    # A malformed duplicate of a good record must not get the good page deleted.
    left_out = [k for k in skipped if k not in kept]
    left_out += [k for items in by_parent.values() for k, _, _ in items]
    return runs, left_out


def restore_records(index: RadixIndex, records: Iterable[DiskRecord | tuple], orphans: list[bytes] | None) -> int:
    """RadixIndex.restore_disk: `disk_runs`, then the runs hung on the tree."""
    with _gc_paused():
        runs, left_out = disk_runs(records, index.salt, index.page_size)
        ends: dict[bytes, TreeNode] = {index.salt: index.root}
        restored = 0
        for run in runs:  # each run's parent page ends an earlier run
            ends[run.keys[-1]] = _hang(index, ends[run.parent_key], run.keys, run.tokens, run.last_access)
            restored += len(run.keys)
    return _report(restored, left_out, orphans)


@dataclass(slots=True)
class ChainedRecords:
    """One namespace's records checked and chained (`chain_packed`), ready to hang on its tree:
    run r is pages [starts[r], ends[r]) of `keys` (packed, in run order) and `tokens`, below
    the run ending at record `parents[r]` (-1: the root); `last_records[r]` is its last
    record, `newest[r]` its newest access time."""

    keys: bytes
    tokens: np.ndarray  # (pages, page_size) int32, in run order
    starts: list[int]
    ends: list[int]
    parents: list[int]
    last_records: list[int]
    newest: list[float]
    left_out: list[bytes]  # keys of the records left out (orphans, corrupt)


def chain_packed(records: PackedRecords, salt: bytes, page_size: int) -> ChainedRecords | None:
    """The records' check and chaining in C (native_restore.c); None where the index's C
    module is not loaded or the tokens are not one page each. Touches no index: safe on
    any thread (the C drops the GIL)."""
    chain = native_index.load()
    n = len(records)
    if chain is None or records.tokens.ndim != 2 or records.tokens.shape[1] != page_size:
        return None
    keys = np.ascontiguousarray(records.keys, dtype=np.uint8)
    tokens = np.ascontiguousarray(records.tokens, dtype=_LE_I4)
    order, run_ends, run_parent, left = (np.empty(n, np.int64) for _ in range(4))
    n_order, n_runs, n_left = chain.chain_runs(keys, np.ascontiguousarray(records.parents, dtype=np.uint8), tokens,
                                               page_size * 4, salt, order, run_ends, run_parent, left)
    order, run_ends = order[:n_order], run_ends[:n_runs]
    starts = np.concatenate(([0], run_ends[:-1])) if n_runs else run_ends
    # np.take of whole rows: ~6x faster than fancy indexing of a 2-D array at a million rows
    return ChainedRecords(np.take(keys.view(_KEY).reshape(-1), order).tobytes(), np.take(tokens, order, axis=0),
                          starts.tolist(), run_ends.tolist(),
                          run_parent[:n_runs].tolist(), order[run_ends - 1].tolist() if n_runs else [],
                          np.maximum.reduceat(records.last_access[order], starts).tolist() if n_runs else [],
                          records.key_list(left[:n_left]))


def restore_packed(index: RadixIndex, records: PackedRecords | ChainedRecords, orphans: list[bytes] | None) -> int:
    """RadixIndex.restore_packed: the records checked and chained in C where the index's
    module is built (else `restore_records`), then the runs hung on the tree."""
    chained = records if type(records) is ChainedRecords else chain_packed(records, index.salt, index.page_size)
    if chained is None:
        return restore_records(index, records.tuples(), orphans)
    restored = 0
    with _gc_paused():
        for restored in hang_steps(index, chained, orphans):
            pass
    return restored


def hang_steps(index: RadixIndex, chained: ChainedRecords, orphans: list[bytes] | None) -> Iterator[int]:
    """Hang the chained runs on `index`, one run a step (yields the pages hung so far), so
    that a caller may let other work run between steps (the daemon's restore of a big disk
    tier answers requests meanwhile: hicache/daemon/movers/disk_restore.py). A run whose
    parent left the tree or the disk between two steps (evicted: a page is on disk only
    below its parent) is left out with every run below it, its keys added to `orphans`."""
    blob, tokens, root = memoryview(chained.keys), chained.tokens, index.root
    k = KEY_BYTES
    ends: dict[int, TreeNode] = {-1: root}
    hung = 0
    left = list(chained.left_out)
    for start, end, parent_rec, last, la in zip(chained.starts, chained.ends, chained.parents,
                                                chained.last_records, chained.newest):
        parent = ends.get(parent_rec)
        if parent is None or parent.removed or (parent is not root and not parent.on_disk):
            left.extend(bytes(blob[i * k:(i + 1) * k]) for i in range(start, end))
            continue
        ends[last] = _hang(index, parent, blob[start * k:end * k], tokens[start:end].reshape(-1), la)
        hung += end - start
        yield hung
    _report(hung, left, orphans)


def _hang(index: RadixIndex, parent: TreeNode, keys: list[bytes] | memoryview, tokens: np.ndarray,
          last_access: float) -> TreeNode:
    """The run on disk below `parent` (keys: a list, or packed): a new leaf, or merged into
    what is there (the index's insert, which splits where they part); the node ending it."""
    packed = type(keys) is memoryview
    first = bytes(keys[:KEY_BYTES]) if packed else keys[0]
    if first in parent.children:
        keys = PackedKeys(bytes(keys)) if packed else keys
        return index._insert_from(parent, keys, tokens, None, None, None, True, last_access, touch=False).nodes[-1]
    leaf = TreeNode(parent=parent, children={}, keys=key_run(keys), tokens=tokens.copy(), last_access=last_access)
    parent.children[first] = leaf
    index._ledger.add_lane(leaf, DISK_LANE, None)
    if index.key_map is not None:
        index.key_map.add(leaf)
    return leaf


def _report(restored: int, left_out: list[bytes], orphans: list[bytes] | None) -> int:
    if orphans is not None:
        orphans.extend(left_out)
    if left_out:
        log.warning("restore_disk: %d records skipped (orphan, corrupt or malformed)", len(left_out))
    log.debug("restore_disk: %d pages restored", restored)
    return restored


class _gc_paused:
    """A bulk build of many small objects: the cyclic GC would rescan them over and over
    (a third of the time at 1M pages) and can find nothing to free."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()
