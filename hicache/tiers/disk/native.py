"""The disk writer's put loop in C: one call writes a run of queued puts and
batch parts (batch.py: each page's key, parent, tokens and row read from the
batch's arrays, no Python object per page): parent check, budget check, XXH3,
then the meta record inserted only if the key is new (``MDB_NOOVERWRITE``: the
dedup test and the insert in one B-tree descent), then the page; inside the
writer's open LMDB transaction, with the GIL released for the whole run.

Why: py-lmdb drops the GIL in every call, and a thread that drops it waits to
get it back for as long as another thread runs Python (the daemon's event loop,
an engine's producer). The writer made 3-4 such calls per page; a 16 KiB page's
``txn.put`` took ~19 us in the writer against ~4 us for raw py-lmdb's whole put
(docs/benchmarks.md), and puts ran at ~0.2 of raw. Here a batch costs one GIL
hand-off, and LMDB's own functions are called from C.

How the C code reaches LMDB without linking it: py-lmdb (3.x) exports its
bundled LMDB's functions (``mdb09_put``, ``mdb10_get``, ...) and one table per
engine (``lmdb_api_v09``, ``lmdb_api_v10``) from its extension module, and a
``Transaction`` object keeps its engine's table pointer right before its
``MDB_txn *``. ``locate_txn`` finds that table pointer among the object's words
(by comparing with the exported tables' addresses, reading only inside the
object) and accepts the layout only if LMDB's own ``txn_id`` of the pointer
after it equals ``Transaction.id()``. Anything else (another py-lmdb build, the
cffi binding, a build without the compiled library, ``HICACHE_NATIVE_DISK=0``)
leaves ``loop()`` None and the writer on its Python path, which the tests run
too. XXH3 is the ``xxhash`` extension's own exported ``XXH3_64bits_dispatch``
(``XXH3_64bits`` where there is no dispatcher), so the checksums are the ones
reads verify with. The C is native.c, compiled by the build (setup.py) into
the library ``hicache.tiers.disk._native``.

The C loop decides only the common case and hands anything else back to the
writer (``STOP_PYTHON``, at that op or page of a part, nothing of it done; the
budget is tested before the dedup, so a duplicate over the budget comes back
too, and Python finds it a duplicate as before): a key already on disk
under another namespace or size, a put over the byte budget or the map budget
(the evict hook is Python's), or one that fits only once freed pages are
reusable. Its budget arithmetic is ``DiskWriter._put``'s, on the same running
totals (``State``). An LMDB error stops the run (``STOP_ERROR``); the writer
raises it as py-lmdb would, so the transaction aborts and the batch is retried
as before: every durability guarantee is LMDB's transaction, unchanged.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import lmdb

from hicache.kernels import native_build
from hicache.tiers.disk import format as fmt

log = logging.getLogger(__name__)

# Per-op results written by the C loop.
NOT_DONE, WRITTEN, DEDUP, ORPHAN = 0, 1, 2, 3
STOP_DONE, STOP_PYTHON, STOP_ERROR = 0, 1, 2

_MDB_MAP_FULL = -30792

class State(ctypes.Structure):
    """hc_state: the running totals of the writer's open transaction, in and out."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "used_bytes", "map_bytes", "deleted_bytes", "capacity_bytes", "map_size", "headroom",
        "batch_limit", "max_footprint", "freed_bytes", "may_defer")] + [("now", ctypes.c_double)] + [
        (name, ctypes.c_int64) for name in (
            "pages_written", "bytes_written", "dedup_puts", "rejected_orphan", "put_bytes_done",
            "stop_index", "stop_page", "stop_why", "stop_rc")]


class NativePutLoop:
    """The loaded loop, bound to one py-lmdb build; ``run`` is per transaction."""

    def __init__(self, lib: ctypes.PyDLL, engine: str, txn_offset: int, lmdb_lib: ctypes.CDLL,
                 hash_fn: int) -> None:
        self._run = lib.hicache_disk_put_run  # PyDLL: called with the GIL, which C drops for the loop
        self._run.argtypes = [ctypes.py_object, ctypes.c_ssize_t, ctypes.py_object, ctypes.py_object,
                              ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.POINTER(State)]
        self._run.restype = ctypes.py_object
        self._dbi = lib.hicache_disk_dbi
        self._dbi.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint)]
        self._dbi.restype = ctypes.c_int
        self.engine = engine
        self._txn_offset = txn_offset
        self._get = ctypes.cast(getattr(lmdb_lib, f"mdb{engine}_get"), ctypes.c_void_p).value
        self._put = ctypes.cast(getattr(lmdb_lib, f"mdb{engine}_put"), ctypes.c_void_p).value
        self._dbi_open = ctypes.cast(getattr(lmdb_lib, f"mdb{engine}_dbi_open"), ctypes.c_void_p).value
        self.lib, self.lmdb_lib = lib, lmdb_lib  # the start-up scans use both (scan.py)
        self._strerror = getattr(lmdb_lib, f"mdb{engine}_strerror")
        self._strerror.argtypes = [ctypes.c_int]
        self._strerror.restype = ctypes.c_char_p
        self._hash = hash_fn

    def lmdb_function(self, name: str) -> int:
        """The address of LMDB's `name` (e.g. "cursor_get") in this py-lmdb build."""
        return ctypes.cast(getattr(self.lmdb_lib, f"mdb{self.engine}_{name}"), ctypes.c_void_p).value

    def txn_pointer(self, txn: lmdb.Transaction) -> int:
        return ctypes.c_void_p.from_address(id(txn) + self._txn_offset).value or 0

    def dbi(self, txn: lmdb.Transaction, name: bytes) -> int:
        """The handle of named database `name` (already open in this environment)."""
        out = ctypes.c_uint()
        rc = self._dbi(self._dbi_open, self.txn_pointer(txn), name, ctypes.byref(out))
        if rc:
            raise lmdb.Error(f"mdb_dbi_open {name!r}: {self.error_text(rc)}")
        return out.value

    def run(self, txn: lmdb.Transaction, pages: int, meta: int, ops: list, lo: int, put_type: type,
            part_type: type, state: State) -> bytes:
        """Write the run of puts from ops[lo]: objects of `put_type` with no ``job`` and no
        ``digest`` (one page each) and batch parts of `part_type` (disk_batch.BatchPart, their
        pages lo..hi). Returns one result per page of the run, in order (WRITTEN / DEDUP /
        ORPHAN; NOT_DONE from where it stopped: before ``state.stop_index``'s op, at its page
        ``stop_page`` if a part, -1 if a put; ``stop_why`` says why)."""
        ptr = self.txn_pointer(txn)
        if not ptr:
            raise lmdb.Error("the transaction is not open")
        return self._run(ops, lo, put_type, part_type, ptr, pages, meta, self._get, self._put, self._hash,
                         ctypes.byref(state))

    def error_text(self, rc: int) -> str:
        return (self._strerror(rc) or b"").decode(errors="replace")

    def error(self, rc: int) -> lmdb.Error:
        """The exception py-lmdb raises for `rc` (the writer's recovery keys on MapFullError)."""
        cls = lmdb.MapFullError if rc == _MDB_MAP_FULL else lmdb.Error
        return cls(f"mdb_put: {self.error_text(rc)}")


LIBRARY = native_build.NativeModule("hicache.tiers.disk._native", "HICACHE_NATIVE_DISK", "writing from Python",
                                    kind="pydll")
_lock = threading.Lock()
_loaded: list[tuple[NativePutLoop | None, str | None]] = []  # [(loop, why not)]; [] = not tried yet


def loop(env: lmdb.Environment) -> NativePutLoop | None:
    """The native put loop for environments of this py-lmdb build, or None (logged
    once) where it was not built or the binding is not the one it knows."""
    with _lock:
        if not _loaded:
            _loaded.append(_load(env))
        return _loaded[0][0]


def unavailable_reason() -> str | None:
    """Why `loop()` was None (None: it loaded, or no writer has asked for it yet)."""
    with _lock:
        return _loaded[0][1] if _loaded else None


def tried() -> bool:
    """Whether a writer has asked for the loop in this process."""
    with _lock:
        return bool(_loaded)


def reset() -> None:
    """Forget the outcome: the next `loop()` loads again (tests change the switch)."""
    with _lock:
        LIBRARY.reset()
        _loaded.clear()


def _load(env: lmdb.Environment) -> tuple[NativePutLoop | None, str | None]:
    lib = LIBRARY.load()
    if lib is None:
        return None, LIBRARY.unavailable_reason()
    try:
        import xxhash._xxhash as xxhash_ext
        import lmdb.cpython as lmdb_ext
        if fmt.META_HEADER_BYTES != 72 or fmt.CHECKSUM_XXH3 != 3:
            raise LookupError("the meta record is not the one the C loop writes")
        lmdb_lib = ctypes.CDLL(lmdb_ext.__file__)  # already loaded: the same handle
        xxh = ctypes.CDLL(xxhash_ext.__file__)
        # the dispatcher picks the CPU's widest path (AVX2: ~3.5x the plain XXH3_64bits here)
        hash_fn = ctypes.cast(getattr(xxh, "XXH3_64bits_dispatch", None) or xxh.XXH3_64bits, ctypes.c_void_p).value
        with env.begin() as txn:
            engine, offset = locate_txn(lmdb_lib, txn, lmdb_ext)
        return NativePutLoop(lib, engine, offset, lmdb_lib, hash_fn), None
    except (ImportError, AttributeError, OSError, LookupError) as e:
        log.warning("native disk writer unusable with this py-lmdb / xxhash, writing from Python: %s", e)
        return None, f"unusable here: {e}"


def locate_txn(lmdb_lib: ctypes.CDLL, txn: lmdb.Transaction, binding: object) -> tuple[str, int]:
    """(engine, offset of the ``MDB_txn *`` in a Transaction object); LookupError
    when the object does not have the layout described in the module docstring."""
    tables = {}
    for engine in ("09", "10"):
        try:
            tables[ctypes.addressof(ctypes.c_char.in_dll(lmdb_lib, f"lmdb_api_v{engine}"))] = engine
        except ValueError:
            pass
    if type(txn) is not getattr(binding, "Transaction", None) or not tables:
        raise LookupError("py-lmdb's C binding with exported engine tables is not loaded")
    base, size = id(txn), type(txn).__basicsize__
    for off in range(16, size - 15, 8):  # both words inside the object
        engine = tables.get(ctypes.c_void_p.from_address(base + off).value or 0)
        if engine is None:
            continue
        ptr = ctypes.c_void_p.from_address(base + off + 8).value
        txn_id = getattr(lmdb_lib, f"mdb{engine}_txn_id")
        txn_id.argtypes, txn_id.restype = [ctypes.c_void_p], ctypes.c_size_t
        if ptr and txn_id(ptr) == txn.id():
            return engine, off + 8
    raise LookupError("py-lmdb's Transaction has an unknown layout")

