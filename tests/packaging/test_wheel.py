"""The sdist and wheel carry everything an installed hicache uses: `python -m build`
makes both from a copy of the source tree, the wheel goes into a fresh virtualenv, and
the commands run there from a directory outside the source tree, importing hicache from
the wheel (the venv sees the system's packages for torch and the core dependencies, as a
machine with torch installed would).

The wheel is a platform wheel with every native module compiled in (setup.py), so the venv
runs with no C compiler to be found (PATH without one, CC=/bin/false) and every native path
runs natively and says so; the sdist, built into a wheel where no compiler works, installs
too and runs those paths in Python, which `hicache stats` and `hicache doctor` report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from hicache.kernels.native_modules import SPECS
from tests.wait import wait_until

SOURCE = Path(__file__).resolve().parents[2]
PACKAGE = SOURCE / "hicache"
VERSION = "0.1.0"
# What the package reads at run time besides its modules (pyproject.toml's package-data).
REQUIRED_DATA = ["hicache/data/systemd/hicache.service", "hicache/data/systemd/hicache.socket",
                 "hicache/data/traces/mooncake_conversation_trace.jsonl.xz",
                 "hicache/data/traces/LICENSE-Mooncake-trace.txt", "hicache/data/traces/README.md",
                 "hicache/data/native_costs.json"]
C_SUFFIXES = (".c", ".h")
# The compiled modules, as this Python names them (cpython-311-x86_64-linux-gnu.so).
NATIVE_FILES = {spec.name.replace(".", "/") + sysconfig.get_config_var("EXT_SUFFIX") for spec in SPECS}
PATHS = ("index", "frame_loop", "disk_writer", "copy")


def _source_files() -> set[str]:
    """Every module, data file and C source of the package in the source tree (not what a
    build put there)."""
    return {p.relative_to(SOURCE).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist + wheel built from a copy of the tree (a build writes egg-info where it runs)."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    shutil.copytree(SOURCE, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", ".*cache*", "*.so"))
    # no isolation: the build backend (setuptools) is installed; nothing is downloaded
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp / "dist"


def _install(wheel: Path, root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
    # --ignore-installed: the venv sees the system's hicache (an editable install wherever setup
    # ran), which pip would otherwise call "already satisfied" and not install
    out = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return root


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    (wheel,) = dist.glob("*.whl")
    return _install(wheel, tmp_path_factory.mktemp("venv") / "venv")


def _env(venv: Path) -> dict[str, str]:
    """The venv on a machine where no C compiler can be found: PATH holds only the venv's
    scripts, and CC names a compiler that fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")}
    env["PATH"] = str(venv / "bin")
    env["CC"] = "/bin/false"
    env.pop("HICACHE_SANITIZE", None)
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None
    return env


def _run(venv: Path, cwd: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([str(venv / "bin" / "hicache"), *args], cwd=cwd, env=_env(venv), capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_sdist_and_wheel_carry_every_module_and_data_file(dist):
    (wheel,) = dist.glob(f"hicache-{VERSION}-*.whl")
    (sdist,) = dist.glob(f"hicache-{VERSION}.tar.gz")
    # a platform wheel of this Python: hicache-0.1.0-cp311-cp311-linux_x86_64.whl
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith(f"hicache-{VERSION}-{tag}-{tag}-linux_"), wheel.name
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = _source_files()
    c_sources = {f for f in wanted if f.endswith(C_SUFFIXES)}
    assert set(REQUIRED_DATA) <= wanted and {f for spec in SPECS for f in spec.sources} <= c_sources
    assert not wanted - c_sources - in_wheel, f"missing from the wheel: {sorted(wanted - c_sources - in_wheel)}"
    assert not NATIVE_FILES - in_wheel, f"native modules missing from the wheel: {sorted(NATIVE_FILES - in_wheel)}"
    assert not in_wheel & c_sources, "the wheel carries the C its modules were built from"
    assert not wanted - in_sdist, f"missing from the sdist: {sorted(wanted - in_sdist)}"
    assert {"setup.py", "MANIFEST.in", "pyproject.toml"} <= in_sdist
    assert not [n for n in in_sdist if n.endswith(".so")], "the sdist carries compiled code"
    print(f"\n{wheel.name}:\n" + "\n".join(sorted(n for n in in_wheel if n.endswith(".so"))))


@contextmanager
def _serving(venv: Path, tmp_path: Path, work: Path):
    """`hicache serve` from the venv (a disk tier: its writer is one of the native paths)."""
    sock, state = tmp_path / "hicache.sock", tmp_path / "state"
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen([str(venv / "bin" / "hicache"), "serve", "--socket", str(sock), "--state-dir", str(state),
                              "--host-capacity", "64MiB", "--disk-capacity", "64MiB"], cwd=work, env=_env(venv),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: sock.exists() or serve.poll() is not None, 60, "the daemon's socket")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        yield str(sock)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        log.close()


def test_the_installed_wheel_runs_every_native_path_without_a_compiler(venv, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    loaded = subprocess.run([str(venv / "bin" / "python"), "-c", "from hicache.rpc import native_conn; "
                             "print(native_conn.load().__file__)"], cwd=work, env=_env(venv), capture_output=True,
                            text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()).resolve().is_relative_to(venv.resolve()), loaded.stdout
    with _serving(venv, tmp_path, work) as sock:
        native = json.loads(_run(venv, work, "stats", "--socket", sock, "--json").stdout)["native"]
        assert list(native) == list(PATHS)
        for path, entry in native.items():
            assert entry["runs"] == "native" and entry["build"].endswith("sanitize=none"), (path, entry)
        assert "native: index, frame loop, disk writer, copy" in _run(venv, work, "stats", "--socket", sock).stdout
        doctor = json.loads(_run(venv, work, "doctor", "--socket", sock, "--json").stdout)
        assert not [c for c in doctor["checks"] if c["name"].startswith("native ") and c["status"] != "ok"]
    assert "not built" not in (tmp_path / "serve.log").read_text()


def test_the_sdist_installs_without_a_compiler_and_runs_the_python_paths(dist, tmp_path):
    """pip builds the sdist's wheel where the compiler fails (CC=/bin/false): the build goes on
    without the modules, and the installed hicache runs every path in Python and says why."""
    (sdist,) = dist.glob(f"hicache-{VERSION}.tar.gz")
    env = {k: v for k, v in os.environ.items() if k not in ("HICACHE_NATIVE_STRICT", "HICACHE_SANITIZE")}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                            "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(sdist)],
                           capture_output=True, text=True, timeout=600, env={**env, "CC": "/bin/false"})
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    venv = _install(wheel, tmp_path / "venv")
    work = tmp_path / "elsewhere"
    work.mkdir()
    with _serving(venv, tmp_path, work) as sock:
        native = json.loads(_run(venv, work, "stats", "--socket", sock, "--json").stdout)["native"]
        for path, entry in native.items():
            assert entry["runs"] == "python" and entry["reason"].startswith("not built: this install has no "
                                                                            "compiled hicache."), (path, entry)
        doctor = json.loads(_run(venv, work, "doctor", "--socket", sock, "--json").stdout)
        warned = {c["name"]: c["detail"] for c in doctor["checks"] if c["status"] == "warn"}
        for path in PATHS:  # each with its measured cost, from the shipped bench rows
            detail = warned[f"native {path.replace('_', ' ')}"]
            assert "x the native time (hicache bench native, " in detail, detail



def test_the_installed_wheel_serves_reports_and_replays_the_shipped_trace(venv, tmp_path):
    work = tmp_path / "elsewhere"  # outside the source tree: nothing may come from there
    work.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import hicache; print(hicache.__file__)"],
                           cwd=work, env=_env(venv), capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()).resolve().is_relative_to(venv.resolve()), where.stdout
    assert _run(venv, work, "--version").stdout.strip() == f"hicache {VERSION}"

    sock, state = tmp_path / "hicache.sock", tmp_path / "state"
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen([str(venv / "bin" / "hicache"), "serve", "--socket", str(sock), "--state-dir", str(state),
                              "--host-capacity", "64MiB", "--disk-capacity", "64MiB"], cwd=work, env=_env(venv),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: sock.exists() or serve.poll() is not None, 60, "the daemon's socket")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        stats = json.loads(_run(venv, work, "stats", "--socket", str(sock), "--json").stdout)
        assert stats["version"] == VERSION and stats["tiers"]["disk"]["capacity_bytes"] == 64 << 20
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        log.close()
    served = (tmp_path / "serve.log").read_text()
    assert f"disk tier: 64.0MiB at {state / 'disk'}" in served  # the capacity and path, printed at start
    assert (state / "disk" / "data.mdb").stat().st_size <= 64 << 20

    # the bench's defaults (the shipped trace, its policies and page size), on its first 200
    # requests and small tiers: CI need not allocate the default 4 GiB disk tier
    out = _run(venv, work, "bench", "trace", "--json", "--limit", "200", "--host-capacity", "64MiB",
               "--disk-capacity", "64MiB", timeout_s=300)
    rows = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    assert rows["requests"]["value"] == 200
    assert 0 < rows["hit rate, all tiers"]["value"] <= rows["hit rate, all tiers"]["baseline"]
