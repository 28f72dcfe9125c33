"""The sdist and wheel carry everything an installed hicache uses: `python -m build`
makes both from a copy of the source tree, the wheel goes into a fresh virtualenv, and
the commands run there from a directory outside the source tree, importing hicache from
the wheel (the venv sees the system's packages for torch and the core dependencies, as a
machine with torch installed would)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.wait import wait_until

SOURCE = Path(__file__).resolve().parents[2]
PACKAGE = SOURCE / "hicache"
VERSION = "0.1.0"
# What the package reads at run time besides its modules (pyproject.toml's package-data).
REQUIRED_DATA = ["hicache/data/systemd/hicache.service", "hicache/data/systemd/hicache.socket",
                 "hicache/data/traces/mooncake_conversation_trace.jsonl.xz",
                 "hicache/data/traces/LICENSE-Mooncake-trace.txt", "hicache/data/traces/README.md"]


def _source_files() -> set[str]:
    """Every module and data file of the package in the source tree."""
    return {p.relative_to(SOURCE).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist + wheel built from a copy of the tree (a build writes egg-info where it runs)."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    shutil.copytree(SOURCE, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".*cache*"))
    # no isolation: the build backend (setuptools) is installed; nothing is downloaded
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp / "dist"


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
    (wheel,) = dist.glob("*.whl")
    # --ignore-installed: the venv sees the system's hicache (an editable install wherever setup
    # ran), which pip would otherwise call "already satisfied" and not install
    out = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return root


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(venv: Path, cwd: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([str(venv / "bin" / "hicache"), *args], cwd=cwd, env=_env(venv), capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_sdist_and_wheel_carry_every_module_and_data_file(dist):
    (wheel,) = dist.glob(f"hicache-{VERSION}-*.whl")
    (sdist,) = dist.glob(f"hicache-{VERSION}.tar.gz")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = _source_files()
    assert set(REQUIRED_DATA) <= wanted
    assert not wanted - in_wheel, f"missing from the wheel: {sorted(wanted - in_wheel)}"
    assert not wanted - in_sdist, f"missing from the sdist: {sorted(wanted - in_sdist)}"
    # the native copy is compiled on first use from a C source inside its module
    assert "_SOURCE" in (PACKAGE / "kernels" / "native_copy.py").read_text()


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
