"""The disk tier's records read whole at start-up: every page's metadata as arrays for the
index rebuild (`MetaScan`), and the key count the verification child takes.

The rebuild needs every page's key, parent, salt, tokens and last access (disk_format's
meta record). Read one record at a time from Python (``DiskTier.iter_meta``), a million
records took ~2 s to scan and as long again to turn into the index's input; the C loop
of scan.c (in the `_native` library, reaching LMDB as the put loop does:
native.py) copies them into a few arrays in a tenth of that. Where that library is
not usable (``HICACHE_NATIVE_DISK=0``, another py-lmdb build), the same arrays are built
from ``iter_meta``: one result either way (tests/tiers/test_disk_scan.py compares them).

A record ``disk_format.unpack_record`` refuses is skipped and counted, never deleted:
what it was cannot be known.

Handed over: the verification child (hicache/tiers/disk/env.py) reads every record
anyway, so where it has the C scan it scans them and writes the arrays into a memfd the
daemon gave it (`dump`), with the id of the LMDB transaction it read in; the daemon
takes them (`load`) only if its own environment's last transaction is that one (nothing
committed since), and scans itself otherwise. One read of the records, in a process of
its own that starts before the daemon's imports.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lmdb
import numpy as np

from hicache.tiers.disk import format as fmt
from hicache.tiers.disk import native as disk_native

_KEY = np.dtype(f"V{fmt.KEY_BYTES}")
_I64P = ctypes.POINTER(ctypes.c_int64)
CHUNK_RECORDS = 1 << 20  # records per call of the C scan (its arrays grow by this much)


@dataclass(slots=True)
class MetaScan:
    """Every well-formed meta record, record i in row i of each array."""

    keys: np.ndarray  # (n, 16) uint8
    parents: np.ndarray  # (n, 16) uint8: the parent page's key, or the salt for a first page
    salts: np.ndarray  # (n, 16) uint8
    last_access: np.ndarray  # (n,) float64
    tok_end: np.ndarray  # (n,) int64: where record i's tokens end in `tokens`
    tokens: np.ndarray  # int32, every record's tokens one after another
    malformed: int = 0  # records skipped

    def __len__(self) -> int:
        return len(self.keys)

    def by_salt(self) -> dict[bytes, np.ndarray | slice]:
        """Each salt's rows (a slice of all of them when there is one salt, the usual case)."""
        n = len(self)
        if not n:
            return {}
        first = self.salts[0]
        if bool((self.salts == first).all()):
            return {first.tobytes(): slice(0, n)}
        uniq, inverse = np.unique(np.ascontiguousarray(self.salts).view(_KEY).reshape(-1), return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
        return {uniq[i].tobytes(): order[bounds[i]:bounds[i + 1]] for i in range(len(uniq))}

    def token_counts(self, rows: np.ndarray | slice) -> np.ndarray:
        ends = self.tok_end
        starts = np.concatenate(([0], ends[:-1]))
        return (ends - starts)[rows]

    def rows_with(self, rows: np.ndarray | slice, num_tokens: int) -> tuple[np.ndarray | slice, np.ndarray]:
        """(the rows among `rows` holding `num_tokens` tokens, the others): a namespace's
        pages all hold its page size; a record that does not is malformed for it."""
        counts = self.token_counts(rows)
        ok = counts == num_tokens
        if bool(ok.all()):
            return rows, np.empty(0, np.int64)
        idx = np.arange(len(self))[rows]
        return idx[ok], idx[~ok]

    def token_rows(self, rows: np.ndarray | slice, num_tokens: int) -> np.ndarray:
        """(len(rows), num_tokens) tokens of rows that all hold num_tokens (rows_with's first)."""
        if isinstance(rows, slice) and rows.start == 0 and len(self.tokens) == len(self) * num_tokens:
            return self.tokens.reshape(-1, num_tokens)[rows]  # every record of the page size: a view
        starts = (self.tok_end[rows] - num_tokens)[:, None]
        return self.tokens[starts + np.arange(num_tokens)]

    def key_list(self, rows: np.ndarray | slice) -> list[bytes]:
        return np.ascontiguousarray(self.keys[rows]).view(_KEY).reshape(-1).tolist()

    def tuples(self, rows: np.ndarray | slice) -> list[tuple[bytes, bytes, np.ndarray, float]]:
        """(key, parent, tokens, last access) of each row, as RadixIndex.restore_disk and the
        hybrid states' restore take them."""
        idx = np.arange(len(self))[rows]
        starts = np.concatenate(([0], self.tok_end[:-1]))
        parents = np.ascontiguousarray(self.parents[idx]).view(_KEY).reshape(-1).tolist()
        return [(k, p, self.tokens[starts[i]:self.tok_end[i]], la) for k, p, i, la in
                zip(self.key_list(idx), parents, idx.tolist(), self.last_access[idx].tolist())]


class NativeScanner:
    """The C scans over environments of one py-lmdb build (disk_native's binding)."""

    def __init__(self, loop: disk_native.NativePutLoop) -> None:
        self._loop = loop
        self._fns = [loop.lmdb_function(n) for n in ("cursor_open", "cursor_get", "cursor_close")]
        self._scan = loop.lib.hicache_disk_scan_meta
        self._scan.restype = ctypes.c_int
        self._scan.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_uint, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
                                                       ctypes.c_int64] + [ctypes.c_void_p] * 7 + [_I64P]
        self._count = loop.lib.hicache_disk_count_keys
        self._count.restype = ctypes.c_int
        self._count.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_uint, ctypes.c_int, _I64P,
                                                        ctypes.POINTER(ctypes.c_uint64)]

    def meta(self, txn: lmdb.Transaction, db_name: bytes, expect: int = 0) -> MetaScan:
        """Every record of the meta database `db_name`, read in `txn`; `expect`: how many
        there should be (the totals record), to size the arrays once."""
        ptr, dbi = self._txn(txn), self._loop.dbi(txn, db_name)
        cap = expect + 1024 if expect else CHUNK_RECORDS
        parts: list[tuple] = []
        start, tok_cap, tok_base, bad = b"", 0, 0, 0
        out = (ctypes.c_int64 * 5)()
        resume = ctypes.create_string_buffer(512)
        while True:
            tok_cap = max(tok_cap, cap * 16)
            a = (np.empty((cap, 16), np.uint8), np.empty((cap, 16), np.uint8), np.empty((cap, 16), np.uint8),
                 np.empty(cap, np.float64), np.empty(cap, np.int64), np.empty(tok_cap, np.int32))
            rc = self._scan(*self._fns, ptr, dbi, start or None, len(start), cap, tok_cap,
                            *(x.ctypes.data for x in a), ctypes.addressof(resume), out)
            if rc:
                raise lmdb.Error(f"scanning {db_name!r}: {self._loop.error_text(rc)}")
            n, nt, done = out[0], out[1], out[3]
            bad += out[2]
            if n < cap and not done:  # stopped for want of token room: more of it next time
                tok_cap *= 4
                if n == 0:
                    continue
            parts.append((a[0][:n], a[1][:n], a[2][:n], a[3][:n], a[4][:n] + tok_base, a[5][:nt]))
            tok_base += nt
            if done:
                break
            start = resume.raw[:out[4]]
            cap = CHUNK_RECORDS
        return MetaScan(*(p[0] if len(parts) == 1 else np.concatenate(p) for p in zip(*parts)), malformed=bad)

    def count_keys(self, txn: lmdb.Transaction, db_name: bytes, read_values: bool = False) -> int:
        """The records of database `db_name`; with `read_values`, every value's bytes are
        read too (the verification child's purpose: a damaged map kills the reader)."""
        n, fold = ctypes.c_int64(), ctypes.c_uint64()
        rc = self._count(*self._fns, self._txn(txn), self._loop.dbi(txn, db_name), int(read_values), ctypes.byref(n),
                         ctypes.byref(fold))
        if rc:
            raise lmdb.Error(f"reading {db_name!r}: {self._loop.error_text(rc)}")
        return n.value

    def _txn(self, txn: lmdb.Transaction) -> int:
        ptr = self._loop.txn_pointer(txn)
        if not ptr:
            raise lmdb.Error("the transaction is not open")
        return ptr


def native_scanner(env: lmdb.Environment) -> NativeScanner | None:
    """The C scans for `env`'s py-lmdb build, or None (disk_native.loop says why)."""
    loop = disk_native.loop(env)
    return None if loop is None else NativeScanner(loop)


def scan_records(records: object) -> MetaScan:
    """A MetaScan of ``DiskTier.iter_meta``'s records: the path without the C scan."""
    keys, parents, salts, las, ends, toks = [], [], [], [], [], []
    end = 0
    for rec in records:
        keys.append(rec.key)
        parents.append(rec.parent_key if rec.parent_key is not None else rec.salt)
        salts.append(rec.salt)
        las.append(rec.last_access)
        toks.append(rec.tokens)
        end += len(rec.tokens)
        ends.append(end)

    def packed(items: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(items), np.uint8).reshape(-1, 16).copy()

    return MetaScan(packed(keys), packed(parents), packed(salts), np.array(las, np.float64), np.array(ends, np.int64),
                    np.concatenate(toks).astype(np.int32) if toks else np.empty(0, np.int32))


def scan(env: lmdb.Environment, meta_db: object, meta_name: bytes, expect: int) -> MetaScan:
    """DiskTier.scan_meta: the C scan in one read transaction, or iter_meta's records."""
    scanner = native_scanner(env)
    if scanner is None:
        return scan_records(iter_meta(env, meta_db))
    with env.begin() as txn:
        return scanner.meta(txn, meta_name, expect)


def iter_meta(env: lmdb.Environment, meta_db: object, chunk: int = 65536) -> Iterator[fmt.DiskRecord]:
    """Every page's metadata, in key order: `chunk` records per short read transaction;
    skips malformed ones."""
    start: bytes | None = None
    unpack = fmt.unpack_record
    while True:
        with env.begin() as txn:
            cur = txn.cursor(db=meta_db)
            positioned = cur.first() if start is None else cur.set_range(start)
            items = list(itertools.islice(cur.iternext(), chunk)) if positioned else []
        for k, v in items:
            rec = unpack(k, v)
            if rec is not None:
                yield rec
        if len(items) < chunk:
            return
        start = items[-1][0] + b"\0"  # the first key after the last one read


_ARRAYS = ("keys", "parents", "salts", "last_access", "tok_end", "tokens")
_LEN = struct.Struct("<Q")


def dump(scan: MetaScan, txn_id: int, fd: int) -> None:
    """Write `scan` (read in transaction `txn_id`) to the file `fd` from its start: a JSON
    header (each array's dtype, shape and offset), then the arrays, 64-byte aligned."""
    arrays = [np.ascontiguousarray(getattr(scan, name)) for name in _ARRAYS]
    specs, off = [], 0
    for a in arrays:
        specs.append([a.dtype.str, list(a.shape), off])
        off += -(-a.nbytes // 64) * 64
    head = json.dumps({"txn_id": txn_id, "malformed": scan.malformed, "arrays": specs}).encode()
    base = -(-(_LEN.size + len(head)) // 64) * 64
    os.ftruncate(fd, base + off)
    os.pwrite(fd, _LEN.pack(len(head)) + head, 0)
    for a, (_, _, at) in zip(arrays, specs):
        if a.nbytes:
            os.pwrite(fd, memoryview(a).cast("B"), base + at)


def load(fd: int) -> tuple[MetaScan, int] | None:
    """(the scan `dump` wrote to `fd`, its transaction id); None when `fd` holds none. The
    arrays are views of a private map of the file (kept while they are)."""
    size = os.fstat(fd).st_size
    if size < _LEN.size:
        return None
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    (n,) = _LEN.unpack_from(mm, 0)
    head = json.loads(bytes(mm[_LEN.size:_LEN.size + n]))
    base = -(-(_LEN.size + n) // 64) * 64
    arrays = [np.frombuffer(mm, dtype=np.dtype(dt), count=int(np.prod(shape)), offset=base + at).reshape(shape)
              for dt, shape, at in head["arrays"]]
    return MetaScan(*arrays, malformed=head["malformed"]), head["txn_id"]
