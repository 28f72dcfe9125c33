"""hicache's native modules: what setup.py compiles into the platform wheel (and into the
source tree for an editable install), and what hicache/kernels/native_build.py loads.

A plain table with no imports from hicache: setup.py reads it with `runpy.run_path`
before the package is installed. Paths are relative to the repository root (the
directory of `hicache/`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

# Included by every module's C: the build's identity (sources' hash, sanitizers).
BUILD_HEADER = "hicache/kernels/native_build.h"


class NativeSpec(NamedTuple):
    name: str  # import name of the built module (a ctypes library's file is named the same way)
    sources: tuple[str, ...]  # .c files compiled into it
    headers: tuple[str, ...]  # .h files they include (besides BUILD_HEADER)


SPECS = (
    NativeSpec("hicache.index._native_index",
               ("hicache/index/native_index.c", "hicache/index/native_sketch.c", "hicache/index/native_restore.c",
                "hicache/index/native_keys.c"),
               ("hicache/index/native_sketch.h", "hicache/index/native_restore.h", "hicache/index/native_blake2b.h",
                "hicache/index/native_keys.h")),
    NativeSpec("hicache.rpc._native_conn",
               ("hicache/rpc/native_conn.c", "hicache/rpc/native_fast_parse.c", "hicache/rpc/native_fast_reply.c"),
               ("hicache/rpc/native_frames.h", "hicache/rpc/native_fast_parse.h",
                "hicache/rpc/native_fast_reply.h")),
    NativeSpec("hicache.tiers.disk._native", ("hicache/tiers/disk/native.c", "hicache/tiers/disk/scan.c"), ()),
    NativeSpec("hicache.kernels._native_copy", ("hicache/kernels/native_copy.c",), ()),
    NativeSpec("hicache.bench.rpc._native_echo", ("hicache/bench/rpc/native_echo.c",), ("hicache/rpc/native_frames.h",)),
)
BY_NAME = {s.name: s for s in SPECS}


def files(spec: NativeSpec) -> tuple[str, ...]:
    """Every file whose bytes go into the module, in a fixed order."""
    return (*spec.sources, *spec.headers, BUILD_HEADER)


def source_hash(root: Path, spec: NativeSpec) -> str | None:
    """SHA-256 over the module's files under `root` (name and bytes of each), or None when
    any is missing there (an installed wheel carries no C)."""
    h = hashlib.sha256()
    for rel in files(spec):
        try:
            data = (root / rel).read_bytes()
        except FileNotFoundError:
            return None
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()
