"""Small C libraries compiled on first use with the system C compiler and loaded
with ctypes, or imported as CPython extension modules (`load_extension`): no build
step at install, and every caller keeps a pure-Python path for machines without a
compiler.

A library is built once per (source, compiler, flags, machine) into a per-user
cache directory (`$HICACHE_NATIVE_DIR`, else `$XDG_CACHE_HOME/hicache` or
`~/.cache/hicache`, mode 0700; one that another user owns or could write is
passed over for a fresh temporary directory), under a name that hashes all of
those, so a changed source never loads a stale build.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    if env := os.environ.get("HICACHE_NATIVE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache"


def build(name: str, source: str, flags: Sequence[str] = ()) -> Path:
    """The compiled shared library of C `source`; raises OSError (no compiler) or
    subprocess.SubprocessError (it did not compile)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc / gcc / $CC)")
    key = hashlib.sha256("\0".join([source, cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    try:
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(out_dir)
    except OSError as e:
        log.debug("native cache %s not usable (%s): building in a private temporary directory", out_dir, e)
        out_dir = Path(tempfile.mkdtemp(prefix="hicache-native-"))
    lib = out_dir / f"{name}-{key}.so"
    if lib.exists():
        check_private(lib)
        return lib
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        built = Path(tmp) / f"{name}.so"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, "-o", str(built), str(src)],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, lib)  # atomic: a concurrent builder's result is the same file
    log.debug("built %s", lib)
    return lib


def check_private(path: Path) -> None:
    """Refuse (OSError) a cache entry another user could have written: the libraries
    are loaded into engine and daemon processes."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} is not private to this user (owner {st.st_uid}, mode {st.st_mode & 0o777:o})")


def load_extension(name: str, source: str) -> ModuleType:
    """Build (cached, as `build`) and import the CPython extension module `name` from C
    `source`, against this Python's headers; raises OSError (no compiler or headers),
    subprocess.SubprocessError (it did not compile) or ImportError."""
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h in {include} (the Python development headers)")
    path = build(name, source, [f"-I{include}"])
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


class Extension:
    """A CPython extension built from C `source` on first use, once per process.

    `load()` is the module, or None where it cannot be built here (no compiler or
    headers, a failed build, or the environment switch `switch=0`): the caller then
    runs its Python path, and `unavailable_reason()` says why (logged once).
    """

    def __init__(self, name: str, source: str, switch: str, fallback: str) -> None:
        self.name = name
        self.source = source
        self.switch = switch  # environment variable; "0" turns the extension off
        self.fallback = fallback  # what runs instead, for the log line
        self._lock = threading.Lock()
        self._loaded: list[tuple[ModuleType | None, str | None]] = []  # [] = not tried yet

    def load(self) -> ModuleType | None:
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0][0]

    def unavailable_reason(self) -> str | None:
        self.load()
        return self._loaded[0][1]

    def _load(self) -> tuple[ModuleType | None, str | None]:
        if os.environ.get(self.switch, "1") == "0":
            return None, f"disabled by {self.switch}=0"
        try:
            return load_extension(self.name, self.source), None
        except (OSError, subprocess.SubprocessError, ImportError) as e:
            log.warning("%s unavailable, %s: %s", self.name, self.fallback, e)
            return None, f"not built: {e}"
