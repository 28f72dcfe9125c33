"""Loading hicache's native modules: C compiled at build time by setup.py (the list:
native_modules.py), shipped in the platform wheel and, for an editable install, built
into the source tree. Nothing is compiled at run time.

`NativeModule(name, switch, fallback).load()` is the module (an imported extension, or a
ctypes library for `kind="cdll"` / `"pydll"`), or None where it cannot run here; its
caller then runs the same path in Python, and `unavailable_reason()` says why (logged
once, as a warning):

- the environment switch (`HICACHE_NATIVE_INDEX=0`, ...) turns it off;
- not built: an install from an sdist on a machine without a C compiler or Python's
  headers, or a source tree nobody built (`pip install -e .`, or `python setup.py
  build_ext --inplace`);
- stale: a source tree whose C changed after the module was built (each module carries
  the SHA-256 of its sources, native_build.h; the check runs only where the sources sit
  beside the module, so never in an installed wheel).

`build_info()` is what the module was built with: "sha256=<hex> sanitize=<list or none>".
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Any

from hicache.kernels import native_modules

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding hicache/ (a checkout or site-packages)
KINDS = ("extension", "cdll", "pydll")


class NativeModule:
    """One built module, loaded once per process (thread-safe)."""

    def __init__(self, name: str, switch: str, fallback: str, kind: str = "extension") -> None:
        if name not in native_modules.BY_NAME or kind not in KINDS:
            raise ValueError(f"unknown native module {name!r} or kind {kind!r}")
        self.name = name
        self.spec = native_modules.BY_NAME[name]
        self.switch = switch  # environment variable; "0" turns the module off
        self.fallback = fallback  # what runs instead, for the log line
        self.kind = kind
        self._lock = threading.Lock()
        self._loaded: list[tuple[Any, str | None, str]] = []  # [(module, reason, build info)]; [] = not tried

    def load(self) -> Any:
        """The module or library, or None (see the module docstring)."""
        return self._result()[0]

    def unavailable_reason(self) -> str | None:
        """Why `load()` is None; None when it loaded."""
        return self._result()[1]

    def build_info(self) -> str:
        """What the loaded module was built with ("" when none loaded)."""
        return self._result()[2]

    def reset(self) -> None:
        """Forget the outcome: the next `load()` tries again (tests change the switch)."""
        with self._lock:
            self._loaded.clear()

    def _result(self) -> tuple[Any, str | None, str]:
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    def _load(self) -> tuple[Any, str | None, str]:
        if os.environ.get(self.switch, "1") == "0":
            return None, f"disabled by {self.switch}=0", ""
        why, info, mod = None, "", None
        spec = importlib.util.find_spec(self.name)
        if spec is None or not spec.origin:
            why = ("not built: this source tree's C was never compiled (pip install -e ., or python setup.py "
                   "build_ext --inplace)" if native_modules.source_hash(_ROOT, self.spec) is not None else
                   f"not built: this install has no compiled {self.name} (installed from the sdist "
                   "without a C compiler or Python's headers?)")
        else:
            try:
                info = read_build_info(spec.origin)
                why = stale_reason(self.spec, info)
                if why is None:
                    loader = {"extension": importlib.import_module, "cdll": ctypes.CDLL, "pydll": ctypes.PyDLL}
                    mod = loader[self.kind](self.name if self.kind == "extension" else spec.origin)
            except (OSError, ImportError) as e:
                why = f"not loadable: {e}"
        if why is not None:
            log.warning("%s %s; %s", self.name, why, self.fallback)
        return mod, why, info


def read_build_info(path: str) -> str:
    """The `hicache_build_info` string compiled into the library at `path`."""
    lib = ctypes.CDLL(path)  # for a module already imported: the same handle, nothing runs twice
    try:
        first = ctypes.c_char.in_dll(lib, "hicache_build_info")
    except ValueError:
        return "unknown"
    return ctypes.string_at(ctypes.addressof(first)).decode(errors="replace")


def stale_reason(spec: native_modules.NativeSpec, info: str) -> str | None:
    """Why a module built with `info` is older than the C beside it, or None when it is
    not, or there is no C beside it (an installed wheel)."""
    current = native_modules.source_hash(_ROOT, spec)
    if current is None or _field(info, "sha256") == current:
        return None
    return (f"stale build: {', '.join(spec.sources)} (or a header) changed since it was compiled; rebuild "
            "with pip install -e . (or python setup.py build_ext --inplace)")


def _field(info: str, key: str) -> str:
    return dict(part.split("=", 1) for part in info.split() if "=" in part).get(key, "")


def sanitizers(info: str) -> str:
    """The sanitizers named in build info `info` ("" for a plain build)."""
    value = _field(info, "sanitize")
    return "" if value in ("", "none") else value
