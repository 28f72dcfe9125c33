"""Export / import RPCs: stream a namespace's disk tier out of one daemon and into another.

The file format (and its checks) is in hicache/portable/format.py; the CLI side
is in hicache/cli/admin.py.

Daemon side (RPC methods, registered in handlers.py):

- ``export_open {namespace}``: the namespace by salt hex prefix or model name;
  its disk pages' metadata is read on a worker thread and ordered depth first.
  Returns the encoded file header. ``export_next {export, max_bytes}`` reads the
  next pages on the disk tier's reader pool and returns them encoded as file
  records (the last chunk ends with the end record); the client appends the bytes
  to its file as they come. A page evicted since ``export_open`` is left out with
  its descendants. Nothing of this changes the cache (reads do not touch LRU).
- ``import_open {header}`` checks the descriptor (format, layout, the page fits a
  host slab and a frame, a disk tier exists) and changes nothing.
  ``import_pages {import, data}`` parses and verifies the whole chunk first (a bad
  chunk is refused and changes nothing), then creates the namespace if needed
  (remembered in the disk mover's namespaces sidecar), writes the pages through
  the disk tier's writer under the disk budget, and once they are committed adds
  them to the index as on-disk. Chunks go one at a time per import.

Indexing a chunk uses RadixIndex.restore_disk with the chunk's pages plus the
path above them (already indexed by earlier chunks, merged as a no-op). If the
disk budget is so small that the import evicts its own earlier pages, such a
path page is flagged on disk again although its bytes are gone; the first
prefetch of it is then a miss, which clears the flag (DiskMover._prefetched).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.portable.format import (
    DEFAULT_CHUNK_BYTES, MAX_EXPORT_CHUNK_BYTES, ExportHeader, PageRecord, PathEntry, PathStack,
    PortableFormatError, decode_header, encode_end, encode_page, page_record_bytes, parse_records,
)
from hicache.rpc.protocol import Code, RpcError

if TYPE_CHECKING:
    from hicache.daemon.serve.context import DaemonContext
    from hicache.daemon.core.service import NamespaceState
    from hicache.rpc.connection import Connection
    from hicache.tiers.disk.tier import DiskRecord, DiskTier

log = logging.getLogger(__name__)

QUEUE_FULL_WAIT_S = 60.0  # a disk queue that stays full this long fails the rest of a chunk


# -- export (daemon) ------------------------------------------------------------------------

def ordered_disk_records(tier: DiskTier, salt: bytes) -> tuple[list[DiskRecord], int]:
    """The namespace's page metadata, parents first and depth first; plus how many
    records were unreachable from the salt (left out). Runs on a worker thread."""
    children: dict[bytes, list[DiskRecord]] = {}
    n = 0
    for rec in tier.iter_meta():
        if rec.salt == salt:
            children.setdefault(rec.parent_key if rec.parent_key is not None else salt, []).append(rec)
            n += 1
    out: list[DiskRecord] = []
    stack = sorted(children.pop(salt, []), key=lambda r: r.key, reverse=True)
    while stack:
        rec = stack.pop()
        out.append(rec)
        stack.extend(sorted(children.pop(rec.key, []), key=lambda r: r.key, reverse=True))
    return out, n - len(out)


def _encode_chunk(records: list[DiskRecord], outs: list[bytearray], hits: list[bool],
                  missing: set[bytes]) -> tuple[bytes, int, int]:
    """Encode the pages read (a page missed, or under a missed one, is left out)."""
    parts: list[bytes] = []
    nbytes = 0
    for rec, out, hit in zip(records, outs, hits):
        if not hit or (rec.parent_key is not None and rec.parent_key in missing):
            missing.add(rec.key)
            continue
        parts.append(encode_page(rec.key, rec.parent_key, rec.tokens.astype("<i4", copy=False).tobytes(), out))
        nbytes += len(out)
    return b"".join(parts), len(parts), nbytes


@dataclass(slots=True, eq=False)
class _Export:
    export_id: int
    ns: NamespaceState
    records: list[DiskRecord]
    pos: int = 0
    pages: int = 0
    page_bytes_total: int = 0
    skipped: int = 0
    missing: set[bytes] = field(default_factory=set)
    busy: bool = False


# -- import (daemon) ------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Import:
    import_id: int
    header: ExportHeader
    stack: PathStack = field(default_factory=PathStack)
    ns: NamespaceState | None = None
    pages: int = 0  # pages received
    imported: int = 0  # pages now on disk and in the index
    skipped: int = 0
    busy: bool = False


@dataclass(slots=True, eq=False)
class _Batch:
    """One chunk's pages in the disk writer; finished on the loop when the last one reports."""

    session: _Import
    entries: list[PathEntry]
    bridge: list[PathEntry]  # the indexed path above the chunk
    future: asyncio.Future
    results: dict[int, bool] = field(default_factory=dict)
    queued: int = 0
    sealed: bool = False


class Portable:
    """The export_* / import_* RPC methods of one daemon."""

    def __init__(self, daemon: DaemonContext) -> None:
        self.daemon = daemon
        self._ids = itertools.count(1)

    def handlers(self) -> dict[str, Any]:
        return {"export_open": self.export_open, "export_next": self.export_next,
                "import_open": self.import_open, "import_pages": self.import_pages}

    # -- helpers ---------------------------------------------------------------------------
    def _mover(self) -> Any:
        if self.daemon.disk is None:
            raise RpcError(Code.BAD_PARAMS, "this daemon runs without a disk tier (--no-disk): "
                                            "export and import need one")
        return self.daemon.disk

    def resolve(self, query: str) -> NamespaceState:
        """A namespace by salt hex prefix or, failing that, by model name; unambiguous only."""
        spaces = list(self.daemon.service.namespaces.values())
        q = query.strip().lower()
        found = [ns for ns in spaces if q and ns.salt.hex().startswith(q)]
        if not found:
            found = [ns for ns in spaces if ns.namespace.model == query]
        if not found:
            raise RpcError(Code.NOT_FOUND, f"no namespace matches {query!r} (see `hicache ls`)")
        if len(found) > 1:
            names = ", ".join(f"{ns.salt.hex()[:16]} ({ns.namespace.model} tp{ns.namespace.tp_rank}/"
                              f"{ns.namespace.tp_size} extra_key={ns.namespace.extra_key!r})" for ns in found)
            raise RpcError(Code.BAD_PARAMS, f"{query!r} is ambiguous: {names}; pass a salt prefix")
        return found[0]

    @staticmethod
    def _session(conn: Connection, kind: str, p: dict) -> Any:
        sid = p.get(kind)
        sess = conn.state.get(kind + "s", {}).get(sid) if type(sid) is int else None
        if sess is None:
            raise RpcError(Code.NOT_FOUND, f"no open {kind} {sid!r} on this connection")
        if sess.busy:
            raise RpcError(Code.BAD_PARAMS, f"{kind} {sid} is busy: send its requests one at a time")
        return sess

    # -- export ------------------------------------------------------------------------------
    async def export_open(self, conn: Connection, p: dict) -> dict:
        query = p.get("namespace")
        if not isinstance(query, str) or len(query) > 1024:
            raise RpcError(Code.BAD_PARAMS, "parameter 'namespace' must be a string (at most 1024 characters)")
        mover = self._mover()
        ns = self.resolve(query)
        records, orphans = await asyncio.to_thread(ordered_disk_records, mover.tier, ns.salt)
        if not records:
            raise RpcError(Code.NOT_FOUND, f"namespace {ns.salt.hex()[:16]} ({ns.namespace.model}) "
                                           "has no pages on disk: nothing to export")
        if orphans:
            log.warning("export of %s: %d disk pages unreachable from the namespace root left out",
                        ns.salt.hex()[:16], orphans)
        sess = _Export(next(self._ids), ns, records, skipped=orphans)
        conn.state.setdefault("exports", {})[sess.export_id] = sess
        log.info("export %d of namespace %s (%s): %d pages", sess.export_id, ns.salt.hex()[:16],
                 ns.namespace.model, len(records))
        return {"export": sess.export_id, "header": ExportHeader.for_namespace(ns.namespace).encode(),
                "namespace": ns.salt.hex(), "model": ns.namespace.model, "pages": len(records),
                "bytes": sum(r.size for r in records)}

    async def export_next(self, conn: Connection, p: dict) -> dict:
        sess: _Export = self._session(conn, "export", p)
        max_bytes = p.get("max_bytes", DEFAULT_CHUNK_BYTES)
        if type(max_bytes) is not int or max_bytes < 1:
            raise RpcError(Code.BAD_PARAMS, "max_bytes must be a positive int")
        # a reply must fit the connection's output cap with room to spare
        max_bytes = min(max_bytes, MAX_EXPORT_CHUNK_BYTES, self.daemon.config.max_output_bytes // 2)
        tier = self._mover().tier
        batch: list[DiskRecord] = []
        size = 0
        for rec in itertools.islice(sess.records, sess.pos, None):
            if batch and size + rec.size > max_bytes:
                break
            batch.append(rec)
            size += rec.size
        sess.busy = True
        try:
            outs = [bytearray(r.size) for r in batch]
            hits = await asyncio.wrap_future(tier.get_many_async(sess.ns.salt, [r.key for r in batch], outs))
            data, n, nbytes = await asyncio.to_thread(_encode_chunk, batch, outs, hits, sess.missing)
        finally:
            sess.busy = False
        sess.pos += len(batch)
        sess.pages += n
        sess.page_bytes_total += nbytes
        sess.skipped += len(batch) - n
        done = sess.pos >= len(sess.records)
        if done:
            data += encode_end(sess.pages, sess.page_bytes_total)
            del conn.state["exports"][sess.export_id]
            log.info("export %d done: %d pages, %d left out", sess.export_id, sess.pages, sess.skipped)
        return {"data": data, "pages": n, "skipped": len(batch) - n, "done": done,
                "sent_pages": sess.pages, "skipped_pages": sess.skipped}

    # -- import ------------------------------------------------------------------------------
    def import_open(self, conn: Connection, p: dict) -> dict:
        raw = p.get("header")
        if not isinstance(raw, bytes):
            raise RpcError(Code.BAD_PARAMS, "parameter 'header' must be bytes")
        self._mover()
        try:
            header = decode_header(raw)
        except PortableFormatError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        host, cfg = self.daemon.host, self.daemon.config
        if header.page_bytes > host.max_page_bytes:
            raise RpcError(Code.BAD_PARAMS, f"pages of {header.page_bytes} bytes need host slabs of twice that, "
                                            f"and this daemon's are {host.slab_bytes} bytes; raise --host-capacity")
        record_bytes = page_record_bytes(header)
        if record_bytes + 4096 > cfg.max_frame_bytes:
            raise RpcError(Code.BAD_PARAMS, f"pages of {header.page_bytes} bytes exceed this daemon's frame cap "
                                            f"of {cfg.max_frame_bytes} bytes; raise max_frame_bytes")
        sess = _Import(next(self._ids), header)
        conn.state.setdefault("imports", {})[sess.import_id] = sess
        n = header.namespace
        log.info("import %d into namespace %s (%s tp%d/%d)", sess.import_id, header.salt.hex()[:16],
                 n.model, n.tp_rank, n.tp_size)
        return {"import": sess.import_id, "namespace": header.salt.hex(),
                "max_chunk_bytes": max(record_bytes, min(DEFAULT_CHUNK_BYTES, cfg.max_frame_bytes // 2))}

    async def import_pages(self, conn: Connection, p: dict) -> dict:
        sess: _Import = self._session(conn, "import", p)
        data = p.get("data")
        if not isinstance(data, bytes):
            raise RpcError(Code.BAD_PARAMS, "parameter 'data' must be bytes")
        sess.busy = True
        try:
            return await self._import_chunk(conn, sess, data)
        finally:
            sess.busy = False

    async def _import_chunk(self, conn: Connection, sess: _Import, data: bytes) -> dict:
        # 1. verify everything before changing anything
        try:
            records, end = await asyncio.to_thread(parse_records, data, sess.header, sess.pages + 1)
            stack = sess.stack.copy()
            # tokens copied: a view would keep the whole chunk alive while the entry is on the path
            entries = [PathEntry(r.key, r.parent, r.tokens.copy()) for r in records]
            writable = []
            for entry in entries:
                parent = stack.place(entry)
                writable.append(parent is None or parent.ok is not False)
                if not writable[-1]:
                    entry.ok = False  # under a page that did not make it: an orphan
        except PortableFormatError as e:
            raise RpcError(Code.BAD_PARAMS, str(e)) from None
        sent = sess.pages + len(records)
        if end is not None and end != (sent, sent * sess.header.page_bytes):
            raise RpcError(Code.BAD_PARAMS, f"the end record counts {end[0]} pages, {sent} were sent "
                                            "(truncated or spliced file)")
        bridge = [e for e in itertools.takewhile(lambda e: e.ok, sess.stack.entries)]
        # 2. write: the namespace, then the pages under the disk budget
        sess.stack = stack
        sess.pages += len(records)
        batch = _Batch(sess, entries, bridge, asyncio.get_running_loop().create_future())
        if records:
            await self._write(sess, batch, records, writable)
        else:
            batch.sealed = True
            self._finish(batch)
        result = await asyncio.shield(batch.future)
        if end is not None:
            del conn.state["imports"][sess.import_id]
            log.info("import %d done: %d pages imported, %d skipped", sess.import_id, sess.imported, sess.skipped)
        return {**result, "done": end is not None, "imported_pages": sess.imported, "skipped_pages": sess.skipped}

    def _namespace(self, sess: _Import) -> NamespaceState:
        if sess.ns is None:
            sess.ns = self.daemon.service.namespace_state(sess.header.namespace)
            self._mover()._remember(sess.ns)
        return sess.ns

    async def _write(self, sess: _Import, batch: _Batch, records: list[PageRecord], writable: list[bool]) -> None:
        mover = self._mover()
        ns = self._namespace(sess)
        loop = asyncio.get_running_loop()
        page_bytes = sess.header.page_bytes
        try:
            for i, (rec, ok) in enumerate(zip(records, writable)):
                if not ok or not mover._make_room(ns, page_bytes):
                    batch.results[i] = False
                    continue
                done = self._done_cb(loop, batch, i, page_bytes)
                mover.inflight_bytes += page_bytes
                deadline = loop.time() + QUEUE_FULL_WAIT_S
                while not mover.tier.put_async(ns.salt, rec.key, rec.parent, rec.tokens, rec.page, done):
                    if loop.time() > deadline or not mover.tier.writable:  # stuck or faulted: fail the page
                        mover.inflight_bytes -= page_bytes
                        batch.results[i] = False
                        break
                    await asyncio.sleep(0.005)  # the queue is full of earlier pages: let it drain
                else:
                    batch.queued += 1
        finally:  # even when cancelled (the client went away): what was queued gets indexed
            batch.sealed = True
            self._finish(batch)

    def _done_cb(self, loop: asyncio.AbstractEventLoop, batch: _Batch, i: int,
                 page_bytes: int) -> Callable[[bytes, bool], None]:
        def done(key: bytes, ok: bool) -> None:  # on the writer thread
            loop.call_soon_threadsafe(self._page_done, batch, i, ok, page_bytes)
        return done

    def _page_done(self, batch: _Batch, i: int, ok: bool, page_bytes: int) -> None:
        self._mover().inflight_bytes -= page_bytes
        batch.results[i] = ok
        batch.queued -= 1
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        """Once every queued page reported: index what was written; orphans leave the disk."""
        if not batch.sealed or batch.queued or batch.future.done():
            return
        sess = batch.session
        for i, entry in enumerate(batch.entries):
            if entry.ok is None:
                entry.ok = batch.results.get(i, False)
        now = time.time()
        written = [e for e in batch.entries if e.ok]
        imported: list[bytes] = []
        if written:
            ns = sess.ns
            records = [(e.key, e.parent or sess.header.salt, e.tokens, now) for e in (*batch.bridge, *written)]
            orphans: list[bytes] = []
            ns.index.restore_disk(records, orphans)
            lost = set(orphans)
            if lost:  # under a page that failed in this chunk (the disk tier rejected it)
                self._mover().tier.delete_async(lost)
                for e in written:
                    e.ok = e.key not in lost
            imported = [e.key for e in written if e.ok]
            if imported:
                self.daemon.service.emit({"type": "stored", "tier": "disk", "engine": None,
                                          "namespace": ns.salt.hex(), "keys": imported})
        sess.imported += len(imported)
        sess.skipped += len(batch.entries) - len(imported)
        batch.future.set_result({"pages": len(imported), "skipped": len(batch.entries) - len(imported)})


def portable_handlers(daemon: DaemonContext) -> dict[str, Any]:
    return Portable(daemon).handlers()
