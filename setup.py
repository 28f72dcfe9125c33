"""Builds hicache's native modules (the table: hicache/kernels/native_modules.py) into the
platform wheel, and into the source tree for an editable install (`pip install -e .`).
Everything else about the package is in pyproject.toml.

Compiled with `-Wall -Wextra`. The build is optional: where a module does not compile (no C
compiler, no Python headers) the install goes on without it and hicache runs that path in
Python (`hicache stats` and `hicache doctor` say so). Two switches, for CI:

- HICACHE_NATIVE_STRICT=1: a warning is an error, and a module that does not compile fails
  the build;
- HICACHE_SANITIZE=address,undefined: built with those sanitizers (scripts/test_sanitized.sh).

Each module carries the SHA-256 of its sources and its sanitizers (native_build.h), so the
loader refuses an in-place build older than the C beside it.
"""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
TABLE = runpy.run_path(str(ROOT / "hicache" / "kernels" / "native_modules.py"))
STRICT = os.environ.get("HICACHE_NATIVE_STRICT") == "1"
SANITIZE = os.environ.get("HICACHE_SANITIZE", "").strip()

# -O2 comes after Python's own -O3, so it wins: the level the native paths are measured at
CFLAGS = ["-O2", "-Wall", "-Wextra", *(["-Werror"] if STRICT else [])]
LDFLAGS: list[str] = []
if SANITIZE:
    # -fno-wrapv: Python's own CFLAGS make signed overflow defined, which hides it from UBSan
    CFLAGS += [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-fno-wrapv", "-g"]
    LDFLAGS += [f"-fsanitize={SANITIZE}"]


def extension(spec) -> Extension:
    info = f"sha256={TABLE['source_hash'](ROOT, spec)} sanitize={SANITIZE or 'none'}"
    return Extension(spec.name, sources=list(spec.sources), depends=[*spec.headers, TABLE["BUILD_HEADER"]],
                     include_dirs=["."], define_macros=[("HICACHE_BUILD_INFO", json.dumps(info))],
                     extra_compile_args=CFLAGS, extra_link_args=LDFLAGS, optional=not STRICT)


setup(ext_modules=[extension(spec) for spec in TABLE["SPECS"]])
