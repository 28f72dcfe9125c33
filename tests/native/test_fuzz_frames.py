"""The frame splitter and the fast path's request parser fuzzed in C (tests/native/fuzz_frames.c,
which says what it checks), built here with AddressSanitizer and UBSan: CI runs a fixed
seed for a few seconds, `--long` for minutes. Without a C compiler it skips, except under
CI=true."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
CI_INPUTS = 200_000
LONG_INPUTS = 20_000_000


def _without_preload() -> dict[str, str]:
    """The environment for the compiler and the fuzzer, which carries its own runtime: the
    sanitized run preloads ASan into Python (scripts/test_sanitized.sh), not into them."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = _compiler()
    if cc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no C compiler: the frame fuzzer must run under CI")
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fuzz") / "fuzz_frames"
    build = subprocess.run([cc, "-O1", "-g", "-Wall", "-Wextra", "-Werror", *SANITIZE, f"-I{ROOT}", "-o", str(out),
                            str(ROOT / "tests/native/fuzz_frames.c"), str(ROOT / "hicache/rpc/native_fast_parse.c")],
                           capture_output=True, text=True, timeout=120, env=_without_preload())
    assert build.returncode == 0, build.stderr[-3000:]
    return out


def test_fuzzed_streams_split_and_parse_within_their_frames(fuzzer, request):
    inputs = LONG_INPUTS if request.config.getoption("--long") else CI_INPUTS
    env = _without_preload()
    env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=1"
    run = subprocess.run([str(fuzzer), str(inputs), "1405"], capture_output=True, text=True, timeout=3600, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    print(run.stdout.strip())
    assert f"{inputs} inputs" in run.stdout
