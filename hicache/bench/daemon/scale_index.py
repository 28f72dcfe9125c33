"""`hicache bench scale --index-only`: the daemon's index at sizes this machine cannot fill
through a daemon, in-process.

The scale bench's workload (hicache/bench/daemon/scale_workload.py) goes through the daemon's own
CacheService and HostPuts, in this process, with no sockets and no disk: a host arena of
`--host-capacity` that evicts as the daemon's does, and every stored page marked on disk at
once (a write-through that keeps up). The heap (RssAnon) per page is read at checkpoints.
Then every disk page's record (key, parent, tokens, last access), as LMDB would hand it
over, is checked, chained and hung on a fresh index in a child process (its heap is that
index's alone): the restart's work after the records are read (hicache/index/restore.py).

Why: at ten million 512-byte pages a daemon on this 2-vCPU VM is held by its disk (the
kernel writing the LMDB map back; docs/benchmarks.md, "A million pages"), so the ten-million
figures are projected from this, next to the same run at a million, which the daemon
itself measured too.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hicache.bench.daemon.scale_workload import LAYOUT, MODEL, SYSTEM_PAGES, Workload
from hicache.bench.report import row
from hicache.config import parse_size
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.daemon.ingest.puts import HostPuts
from hicache.index.admission import AdmissionConfig, DiskAdmission, admission_capacity_pages
from hicache.index.keys import Namespace, PackedKeys, page_keys
from hicache.index.node import Tier
from hicache.index.radix import RadixIndex
from hicache.index.restore import PackedRecords, chain_packed

_RECORDS = ("keys", "parents", "tokens", "last_access")


def _heap() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def fill(pages: int, host_bytes: int, checkpoints: list[int], out_dir: Path) -> list[dict]:
    """Store `pages` pages in-process (module docstring); the rows of each checkpoint, and
    the disk records written to `out_dir` for `rebuild`."""
    host = HostTier(host_bytes, mlock=False)
    svc = CacheService(host)
    svc.admission = DiskAdmission(AdmissionConfig(), admission_capacity_pages(host_bytes))
    svc.on_host_stored = lambda ns, nodes: [ns.index.set_disk(n, True) for n in nodes
                                            if not n.on_disk and not n.removed]
    puts = HostPuts(svc)
    owner = object()
    rec = svc.register(owner, Namespace(MODEL, LAYOUT), 1 << 16)
    salt, index, ps, w = rec.ns.salt, rec.ns.index, LAYOUT.page_size, Workload()
    rng = np.random.default_rng(w.seed)
    systems = rng.integers(1, 1 << 30, (w.system_prompts, SYSTEM_PAGES * ps), dtype=np.int32)
    system_keys = [page_keys(salt, t, ps) for t in systems]
    active: list[list] = []  # [turns left, tokens, keys]
    stored, rows, todo = 0, [], sorted(checkpoints)
    gc.collect()
    heap0, t0 = _heap(), time.perf_counter()
    while stored < pages:
        while len(active) < w.in_flight:
            s = int(rng.integers(w.system_prompts))
            active.append([int(rng.integers(w.turns[0], w.turns[1] + 1)), systems[s], list(system_keys[s])])
        for c in active:
            new = rng.integers(1, 1 << 30, int(rng.integers(w.turn_pages[0], w.turn_pages[1] + 1)) * ps,
                               dtype=np.int32)
            c[2] = c[2] + page_keys(salt, new, ps, parent=c[2][-1])
            c[1] = np.concatenate([c[1], new])
            c[0] -= 1
        for c in active:  # the scheduler's lookups, then its puts, as the scale bench's engine
            svc.drop_pin(svc.match_engine(rec, PackedKeys(b"".join(c[2]))))
        for c in active:
            res, _ = puts.put(owner, rec.engine_id, PackedKeys(b"".join(c[2])), c[1])
            if res is not None:
                stored += puts.done(owner, rec.engine_id, res.res_id, True)
        active = [c for c in active if c[0] > 0]
        while todo and stored >= todo[0]:
            todo.pop(0)
            gc.collect()
            nodes = sum(1 for _ in index.iter_nodes())
            rows.append(row(f"index heap per page at {stored} pages", (_heap() - heap0) / stored, "B/page",
                            note=f"in-process; {index.num_pages(Tier.HOST)} pages on host, "
                                 f"{index.num_pages(Tier.DISK)} on disk, {nodes} nodes, "
                                 f"{stored / (time.perf_counter() - t0):.0f} pages/s"))
    _write_records(index, salt, out_dir)
    return rows


def _write_records(index: RadixIndex, salt: bytes, out_dir: Path) -> None:
    keys, parents, tokens, newest = [], [], [], []
    for node in index.iter_nodes():
        if not node.on_disk:
            continue
        n = node.n_pages
        above = node.parent.keys[-1] if node.parent.keys else salt
        keys.append(node.keys.blob)
        parents.append(above + node.keys.blob[:-16])
        tokens.append(node.tokens)
        newest.append(np.full(n, node.last_access))
    arrays = (np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16),
              np.frombuffer(b"".join(parents), np.uint8).reshape(-1, 16),
              np.concatenate(tokens).reshape(-1, LAYOUT.page_size), np.concatenate(newest))
    order = np.random.default_rng(1).permutation(len(arrays[0]))  # LMDB hands them in key order: any order
    for name, a in zip(_RECORDS, arrays):
        np.save(out_dir / f"{name}.npy", np.take(a, order, axis=0))
    (out_dir / "salt").write_bytes(salt)


def rebuild(out_dir: Path) -> dict:
    """The restart's work on the records `fill` wrote: check and chain, then hang the runs on
    a fresh index (in this process: run it in a child of its own)."""
    gc.collect()
    heap0 = _heap()
    salt = (out_dir / "salt").read_bytes()
    records = PackedRecords(*(np.load(out_dir / f"{name}.npy") for name in _RECORDS))
    n = len(records)
    t0 = time.perf_counter()
    chained = chain_packed(records, salt, LAYOUT.page_size)
    t1 = time.perf_counter()
    index = RadixIndex(LAYOUT.page_size, salt)
    restored = index.restore_packed(chained if chained is not None else records, [])
    t2 = time.perf_counter()
    del chained, records
    gc.collect()
    return {"records": n, "restored": restored, "check_s": t1 - t0, "hang_s": t2 - t1,
            "nodes": sum(1 for _ in index.iter_nodes()), "heap_b": (_heap() - heap0) / max(1, n)}


def run(args: object) -> list[dict]:
    pages = args.pages
    checkpoints = sorted({min(pages, c) for c in (1_000_000, 2_000_000, 5_000_000, pages)})
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hicache-scale-index-", dir=args.workdir) as tmp:
        rows = [row("load average (1 min) at the start", load0, "")]
        rows += fill(pages, parse_size(args.host_capacity), checkpoints, Path(tmp))
        out = subprocess.run([sys.executable, "-m", "hicache.bench.daemon.scale_index", tmp], capture_output=True,
                             text=True, check=True, env=dict(os.environ))
    r = json.loads(out.stdout)
    rows.append(row(f"restart's work on {r['records']} records: checked and chained", r["check_s"], "s",
                    note="in C, the hashing on every core (hicache/index/native_restore.c)"))
    rows.append(row(f"restart's work on {r['records']} records: runs hung on a fresh index", r["hang_s"], "s",
                    note=f"{r['restored']} pages in {r['nodes']} nodes"))
    rows.append(row("heap per page of the rebuilt index", r["heap_b"], "B/page",
                    note="its own process: no heap of the fill in it"))
    return rows


if __name__ == "__main__":  # the rebuild's child: `python -m hicache.bench.daemon.scale_index DIR`
    print(json.dumps(rebuild(Path(sys.argv[1]))))
