"""The docs site builds strictly, and every command it shows is one that works.

Shell blocks are fenced ```bash. A block titled runnable (```bash title="runnable") is run,
line by line, against a daemon this test starts (HICACHE_SOCKET_PATH), in a scratch
directory holding the committed inputs under docs/img; each line must exit 0. Every other
```bash line is checked without running it: a `hicache ...` (or `python -m hicache.cli ...`)
line must parse with the CLI's own argparse parser, `bash scripts/X` and repository paths
must exist, `python -m hicache.X` must import, JSON arguments must parse, and any other
program must be one of the outside tools listed here. README.md is checked the same way.
Under CI=true a missing MkDocs fails instead of skipping (scripts/setup.sh installs it)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)

# Programs of other projects the docs show (how to install or run them beside hicache);
# they are not run here. A new one must be added on purpose.
OUTSIDE_TOOLS = {
    "pip": "installs hicache and its extras",
    "mooncake_master": "Mooncake Store's master (tests/remote/test_mooncake.py starts it with these flags)",
    "mooncake_client": "a Mooncake Store storage process (the same test starts two)",
    "vllm": "vLLM's server (tests/integrations/test_vllm_serve.py runs it with the JSON shown)",
    "useradd": "the service user (docs/operations/systemd.md)",
    "usermod": "the service group",
    "cp": "copies the unit files",
    "systemd-analyze": "tests/service/test_units.py verifies the units",
    "systemctl": "starts the units",
    "openssl": "makes a cluster secret",
}
OUTSIDE_MODULES = {
    "sglang.launch_server": "SGLang's server (no GPU here: its storage backend is tested)",
    "pip": "installs hicache and its extras",
    "mooncake_master": "Mooncake Store's master (tests/remote/test_mooncake.py starts it with these flags)",
    "mooncake_client": "a Mooncake Store storage process (the same test starts two)",
    "venv": "a fresh virtualenv for the package",
    "build": "builds the sdist and wheel",
}


@dataclass(frozen=True)
class Block:
    page: Path
    runnable: bool
    text: str


def shell_blocks() -> list[Block]:
    out = []
    for page in PAGES:
        for lang, attrs, body in FENCE.findall(page.read_text()):
            if lang in ("bash", "sh", "shell", "console"):
                out.append(Block(page, 'title="runnable"' in attrs, body))
    return out


def commands(text: str) -> list[str]:
    """The block's commands: backslash-continued and quoted newlines joined, comments dropped."""
    cmds, cur, quote, i = [], [], None, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            cur.append(c)
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "\\" and text[i + 1:i + 2] == "\n":
            i += 1
        elif c == "#" and (not cur or cur[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "\n":
            cmds.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    cmds.append("".join(cur))
    return [c.strip() for c in cmds if c.strip()]


def argv_of(cmd: str) -> list[str]:
    """The first command of a pipeline, its environment assignments, redirections and `&` dropped."""
    argv = shlex.split(cmd.split(" | ")[0])
    for op in (">", ">>", "2>", "<"):
        while op in argv:
            at = argv.index(op)
            del argv[at:at + 2]
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    if argv and argv[-1] == "&":
        argv = argv[:-1]
    return argv


def check_command(cmd: str) -> None:
    argv = argv_of(cmd)
    assert argv, f"an empty command: {cmd!r}"
    prog, args = argv[0], argv[1:]
    if prog in ("python", "python3") and args[:1] == ["-m"]:
        module, args = args[1], args[2:]
        if module == "hicache.cli":
            prog = "hicache"
        elif module.startswith("hicache."):
            assert importlib.util.find_spec(module), f"{cmd!r}: no module {module}"
            return
        else:
            assert module in OUTSIDE_MODULES, f"{cmd!r}: {module} is neither hicache's nor a listed outside module"
            _check_json_args(cmd, args)
            return
    if prog == "hicache":
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(args)
        except SystemExit as e:
            if e.code != 0:  # 0: --help
                raise AssertionError(f"{cmd!r} does not parse with hicache's CLI (exit {e.code})") from None
        return
    if prog == "bash":
        assert args and (REPO / args[0]).is_file(), f"{cmd!r}: no script {args[:1]}"
        return
    assert prog in OUTSIDE_TOOLS, f"{cmd!r}: {prog} is neither hicache nor a listed outside tool"
    for a in args:  # repository files a command names must exist
        if re.match(r"(systemd|scripts|docs|hicache)/", a):
            assert (REPO / a).exists(), f"{cmd!r}: no {a} in the repository"
    _check_json_args(cmd, args)


def _check_json_args(cmd: str, args: list[str]) -> None:
    for a in args:
        if a.startswith("{"):
            try:
                json.loads(a)
            except ValueError as e:
                raise AssertionError(f"{cmd!r}: its JSON argument does not parse ({e})") from None


def test_the_command_splitter_joins_continuations_and_drops_comments():
    text = ("hicache serve &   # or the unit\n# a comment line\nvllm serve M --x '{\"a\":\n  1}'\n"
            "python -m a \\\n  --b c\n")
    assert commands(text) == ["hicache serve &", "vllm serve M --x '{\"a\":\n  1}'", "python -m a   --b c"]
    assert argv_of("HICACHE_X=1 hicache serve --no-disk &") == ["hicache", "serve", "--no-disk"]
    assert argv_of("hicache bench vllm --json > out.json") == ["hicache", "bench", "vllm", "--json"]


def test_a_command_with_a_wrong_flag_or_an_unknown_program_is_caught():
    with pytest.raises(AssertionError, match="does not parse"):
        check_command("hicache stats --no-such-flag")
    with pytest.raises(AssertionError, match="does not parse"):
        check_command("hicache bench trace --plot")
    with pytest.raises(AssertionError, match="listed outside tool"):
        check_command("curl http://example.invalid")
    with pytest.raises(AssertionError, match="no script"):
        check_command("bash scripts/no_such_script.sh")


def test_every_shown_command_is_a_real_invocation():
    blocks = shell_blocks()
    assert any(b.runnable for b in blocks) and any(not b.runnable for b in blocks)
    checked = 0
    for b in blocks:
        for cmd in commands(b.text):
            try:
                check_command(cmd)
            except AssertionError as e:
                raise AssertionError(f"{b.page.relative_to(REPO)}: {e}") from None
            checked += 1
    assert checked > 20


def inline_invocations() -> list[tuple[Path, str]]:
    """`hicache ... --flag ...` spans in the prose: full invocations, not usage notation (spans
    with <placeholders>, [optional] parts, alternatives a|b, ... or NAME-style words are left out)."""
    out = []
    for page in PAGES:
        prose = FENCE.sub("", page.read_text()).replace("\n", " ")
        for span in re.findall(r"`([^`]+)`", prose):
            if (re.match(r"(hicache|python -m hicache\.cli) ", span) and " --" in span
                    and not re.search(r"[<\[|]|\.\.\.|\b[A-Z]{2,}\b", span)):
                out.append((page, span))
    return out


def test_every_inline_invocation_parses():
    spans = inline_invocations()
    assert len(spans) > 10
    for page, span in spans:
        try:
            check_command(span)
        except AssertionError as e:
            raise AssertionError(f"{page.relative_to(REPO)}: {e}") from None


def test_the_readme_keeps_its_two_commands():
    text = (REPO / "README.md").read_text()
    assert "```bash\nbash scripts/demo.sh\n```" in text
    assert "```bash\nbash scripts/test.sh\n```" in text
    assert len(text.splitlines()) <= 250


def test_runnable_blocks_run(daemon_factory, tmp_path):
    if not os.environ.get("CI"):  # the chart blocks need the plot extra, which setup installs
        pytest.importorskip("matplotlib")
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "64MiB").start()
    work = tmp_path / "work"
    (work / "docs" / "img").mkdir(parents=True)
    for inp in (REPO / "docs" / "img").glob("*.json"):  # the inputs a block redraws
        shutil.copy(inp, work / "docs" / "img" / inp.name)
    bin_dir = tmp_path / "bin"  # `hicache` is the tree under test, whatever is installed
    bin_dir.mkdir()
    shim = bin_dir / "hicache"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m hicache.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HICACHE_SOCKET_PATH": d.socket,
           "PYTHONPATH": str(REPO)}
    ran = []
    for b in (b for b in shell_blocks() if b.runnable):
        for cmd in commands(b.text):
            r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=240)
            assert r.returncode == 0, f"{b.page.relative_to(REPO)}: {cmd!r} exited {r.returncode}:\n{r.stderr[-2000:]}"
            ran.append(cmd)
    assert any(c.startswith("hicache stats") for c in ran)
    for png in (work / "docs" / "img").glob("*.png"):  # what the chart blocks drew is a readable image
        from PIL import Image

        with Image.open(png) as im:
            assert im.size[0] > 100 and im.size[1] > 100


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        if os.environ.get("CI"):
            raise RuntimeError("mkdocs-material is not installed: scripts/setup.sh installs it")
        pytest.skip("mkdocs-material is not installed (scripts/setup.sh installs it)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()
    # the charts the benchmarks page shows are in the site
    html = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    for img in re.findall(r"\]\((img/[^)]+)\)", (REPO / "docs" / "benchmarks.md").read_text()):
        assert (tmp_path / "site" / img).is_file() and img in html
