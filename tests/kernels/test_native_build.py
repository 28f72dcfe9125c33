"""The native modules' loader (hicache/kernels/native_build.py) on real copies of the package:
one never built runs every path in Python and says so; a built one whose C then changes
refuses the modules built from that C as stale and loads the rest; setup.py's table
(native_modules.py) and the loaders name the same modules; each module loaded here is the
build of the C beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.bench.rpc import native_echo
from hicache.index import native_index
from hicache.kernels import native_build, native_copy, native_modules
from hicache.rpc import native_conn
from hicache.tiers.disk import native as disk_native

ROOT = Path(__file__).resolve().parents[2]
LOADERS = (native_index.EXTENSION, native_conn.EXTENSION, disk_native.LIBRARY, native_copy.LIBRARY,
           native_echo.EXTENSION)
PROBE = """
import json
from hicache.bench.rpc import native_echo
from hicache.index import native_index
from hicache.kernels import native_copy
from hicache.rpc import native_conn
from hicache.tiers.disk import native as disk_native
mods = (native_index.EXTENSION, native_conn.EXTENSION, disk_native.LIBRARY, native_copy.LIBRARY, native_echo.EXTENSION)
print(json.dumps({m.name: [m.load() is not None, m.unavailable_reason()] for m in mods}))
"""


def probe(tree: Path, env: dict[str, str] | None = None) -> dict[str, list]:
    """Which modules the package copy in `tree` loads, in a fresh interpreter."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_NATIVE_")}
    run_env.update(PYTHONPATH=str(tree), **(env or {}))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, env=run_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def copy_package(tmp_path: Path, builds: bool) -> Path:
    ignore = ["__pycache__", "traces"] + ([] if builds else ["*.so"])
    shutil.copytree(ROOT / "hicache", tmp_path / "hicache", ignore=shutil.ignore_patterns(*ignore))
    return tmp_path


def test_setup_and_the_loaders_name_the_same_modules():
    assert {m.name for m in LOADERS} == set(native_modules.BY_NAME)
    for spec in native_modules.SPECS:
        for rel in native_modules.files(spec):
            assert (ROOT / rel).is_file(), rel
    assert {m.kind for m in LOADERS} == {"extension", "cdll", "pydll"}


def test_each_loaded_module_is_the_build_of_the_c_beside_it():
    loaded = [m for m in LOADERS if m.load() is not None]
    if not loaded:
        if os.environ.get("CI") == "true":
            pytest.fail("no native module loaded under CI")
        pytest.skip("the native modules are not built here")
    for m in loaded:
        assert f"sha256={native_modules.source_hash(ROOT, m.spec)} " in m.build_info(), m.name


def test_a_source_tree_never_built_runs_every_path_in_python_and_says_so(tmp_path):
    loaded = probe(copy_package(tmp_path, builds=False))
    assert set(loaded) == set(native_modules.BY_NAME)
    for name, (ok, why) in loaded.items():
        assert not ok and why.startswith("not built: this source tree's C was never compiled"), (name, why)


def test_a_module_older_than_its_c_is_refused_as_stale_and_the_rest_load(tmp_path):
    if any(m.load() is None for m in LOADERS):
        if os.environ.get("CI") == "true":
            pytest.fail("the native modules must be built under CI")
        pytest.skip("the native modules are not built here")
    tree = copy_package(tmp_path, builds=True)
    assert all(ok for ok, _ in probe(tree).values())
    frames = tree / "hicache" / "rpc" / "native_frames.h"  # shared by the frame loop and the echo servers
    frames.write_text(frames.read_text() + "/* edited after the build */\n")
    loaded = probe(tree, {"HICACHE_NATIVE_INDEX": "0"})
    stale = {"hicache.rpc._native_conn", "hicache.bench.rpc._native_echo"}
    for name, (ok, why) in loaded.items():
        if name in stale:
            assert not ok and why.startswith("stale build: ") and "pip install -e ." in why, (name, why)
        elif name == "hicache.index._native_index":
            assert not ok and why == "disabled by HICACHE_NATIVE_INDEX=0"
        else:
            assert ok and why is None, (name, why)


def test_build_info_names_the_sanitizers():
    assert native_build.sanitizers("sha256=ab sanitize=address,undefined") == "address,undefined"
    assert native_build.sanitizers("sha256=ab sanitize=none") == ""
    assert native_build.sanitizers("unknown") == ""
