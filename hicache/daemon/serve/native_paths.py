"""Which of the daemon's hot paths run in C and which in Python, and why: the `native` section
of `stats` (`hicache stats`, and /metrics as `hicache_native_path`), from which `hicache
doctor` warns for every path in Python with what that costs (hicache/cli/doctor.py).

Each path is `{"runs": "native" | "python" | "unused", "reason": ..., "build": ...}`:
`reason` names the loaded module, or says why the Python path runs (the switch that turned
it off, a build without it, ...); `build` is what the module was compiled from and with
("sha256=<hex> sanitize=<list or none>", empty when none loaded). The copy is the daemon's
own; an engine's process loads its own copy of the library (its log says if it cannot).
"""

from __future__ import annotations

from hicache.index import native_index
from hicache.kernels import native_build, native_copy
from hicache.rpc import native_conn
from hicache.tiers.disk import native as disk_native

PATHS = ("index", "frame_loop", "disk_writer", "copy")
RUNS = ("native", "python", "unused")


def _entry(runs: str, reason: str, build: str = "") -> dict[str, str]:
    return {"runs": runs, "reason": reason, "build": build}


def _module(module: native_build.NativeModule) -> dict[str, str]:
    if module.load() is None:
        return _entry("python", module.unavailable_reason() or "")
    return _entry("native", f"loaded {module.name}", module.build_info())


def report(frame_loop: str, disk_tier: bool) -> dict[str, dict[str, str]]:
    """The daemon's paths: `frame_loop` is its RPC server's ("native", "asyncio", "" before
    it serves), `disk_tier` whether it has one (whose writer then has asked for its loop)."""
    if frame_loop == "native":
        rpc = _module(native_conn.EXTENSION)
    elif frame_loop == "asyncio":
        rpc = _entry("python", native_conn.unavailable_reason() or "the server was started on asyncio")
    else:
        rpc = _entry("unused", "not serving yet")
    if not disk_tier:
        disk = _entry("unused", "no disk tier")
    elif not disk_native.tried():
        disk = _entry("python", "the disk tier's config turns the native writer off (native_writer=False)")
    elif disk_native.unavailable_reason() is not None:
        disk = _entry("python", disk_native.unavailable_reason() or "")
    else:
        disk = _module(disk_native.LIBRARY)
    native_copy.chunk_copy()  # loads it, if nothing has yet
    return {"index": _module(native_index.EXTENSION), "frame_loop": rpc, "disk_writer": disk,
            "copy": _module(native_copy.LIBRARY)}
