"""The radix index's hot loops in C, over the index's own TreeNode objects: the walk of
RadixIndex.match and the lock and unlock loops of a match's segments.

Why: each is a few dict lookups, key comparisons and counter updates per node, on the
path every engine request waits on (match, then release); in Python each step is an
interpreter round and the calls around them cost more than the steps. The C loops do
the same steps through the CPython C API on the same objects (the C source and what each
function mirrors: native_index_source.py): there is no second copy of the tree that could
drift from it.

`walk(root, blob, lane, seg, now)` walks from `root` along the packed 16-byte page keys
in `blob` as tree_walk.walk_path does (same segment rules, same key comparisons,
`last_access = now` and `hit_count += 1` on every node it passes) and returns `(path,
n_dev, n_host, j)`. When the request diverges or ends inside the last node of `path`,
that node is left untouched and `j` is the number of its pages that match: the caller
splits it there and touches the upper part (the split stays Python's, split_node).
Otherwise `j` is -1.

The extension is compiled on first use against this Python's headers
(hicache/kernels/native_build.py; the daemon builds it at startup). Without a compiler
or headers, or with `HICACHE_NATIVE_INDEX=0`, `load()` returns None and the index runs
the same loops in Python (tests/index/test_native_index.py runs both on random trees).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sysconfig
import threading
from types import ModuleType

from hicache.index.native_index_source import SOURCE
from hicache.kernels import native_build

log = logging.getLogger(__name__)

_MODULE = "hicache_native_index"
_lock = threading.Lock()
_loaded: list[tuple[ModuleType | None, str | None]] = []  # [] = not tried yet


def load() -> ModuleType | None:
    """The compiled walk, or None where it cannot be built here (logged once)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0][0]


def unavailable_reason() -> str | None:
    load()
    return _loaded[0][1]


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("HICACHE_NATIVE_INDEX", "1") == "0":
        return None, "disabled by HICACHE_NATIVE_INDEX=0"
    try:
        include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "Python.h")):
            raise OSError(f"no Python.h in {include} (the Python development headers)")
        path = native_build.build(_MODULE, SOURCE, [f"-I{include}"])
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod, None
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        log.warning("the radix index's C loops are unavailable, running them in Python: %s", e)
        return None, f"not built: {e}"
