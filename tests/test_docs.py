"""The docs site builds strictly, and every command it shows is one that works.

Shell blocks are fenced ```bash. A block titled runnable (```bash title="runnable") is run,
line by line, against a daemon this test starts (HICACHE_SOCKET_PATH), in a scratch
directory holding the committed inputs under docs/img; each line must exit 0. Every other
```bash line is checked without running it: a `hicache ...` (or `python -m hicache.cli ...`)
line must parse with the CLI's own argparse parser, `bash scripts/X` and repository paths
must exist, `python -m hicache.X` must import, JSON arguments must parse, and any other
program must be one of the outside tools listed here. README.md is checked the same way.
Under CI=true a missing MkDocs fails instead of skipping (scripts/setup.sh installs it).

The benchmarks page opens with a table of the current figures rendered from
docs/data/current.json by `render_current` below (`python tests/test_docs.py` rewrites it
in the page); the tests here fail when the page's table is not what the JSON renders, when
a row reads a figure a committed bench output does not hold, or when the README's
"Measured" figures are not the page's."""

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
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
BENCHMARKS = REPO / "docs" / "benchmarks.md"
HISTORY = REPO / "docs" / "benchmarks-history.md"
CURRENT = REPO / "docs" / "data" / "current.json"
CURRENT_BEGIN = "<!-- current figures: rendered from docs/data/current.json by tests/test_docs.py -->"
CURRENT_END = "<!-- end of current figures -->"
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
    "systemd-analyze": "tests/systemd/test_units.py verifies the units",
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


def anchor(heading: str) -> str:
    """The id MkDocs gives a heading (Python-Markdown's default slugify, code spans unwrapped)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def headings(page: Path) -> dict[str, int]:
    """Each heading's anchor and level, fenced blocks left out."""
    found = re.findall(r"^(#{1,6}) (.+?)\s*$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {anchor(text): len(hashes) for hashes, text in found}


def current_figure(row: dict) -> tuple[str, str, str]:
    """A row's figure, date and source cell: read from the bench's committed --json output
    it names ("from"), or transcribed with the run it came from ("source")."""
    if "from" in row:
        assert "date" not in row and "source" not in row, f"{row['what']}: a JSON row takes its date from the JSON"
        doc = json.loads((REPO / row["from"]).read_text())
        results = {r["name"]: r for r in doc["results"]}
        values = {}
        for key, (name, field, fmt) in row["values"].items():
            assert name in results, f"{row['what']}: {row['from']} has no result row {name!r}"
            values[key] = format(results[name][field], fmt)
        path = row["from"]
        cell = f"[{Path(path).name}]({path.removeprefix('docs/')})" if path.startswith("docs/") else f"`{path}`"
        return row["figure"].format(**values), doc["date"], cell
    assert row.get("source", "").startswith("transcribed from the run"), f"{row['what']}: no source, no JSON"
    return row["figure"], row["date"], f"[transcribed](benchmarks-history.md#{row['history']})"


def current_line(row: dict, machines: dict) -> str:
    """One row of the current figures' table."""
    figure, date, source = current_figure(row)
    assert row["machine"] in machines, f"{row['what']}: unknown machine {row['machine']!r}"
    machine = f"{row['machine']}, load {row['load']}" if "load" in row else row["machine"]
    cells = [f"[{row['what']}](#{row['section']})", row["baseline"], figure, date, f"`{row['command']}`", machine,
             source]
    assert not any("|" in c for c in cells), f"{row['what']}: a '|' would split the table's cells"
    return "| " + " | ".join(cells) + " |"


def render_current(data: dict) -> str:
    """The benchmarks page's first table and its machines, as the page carries them."""
    lines = ["| what | baseline | figure | date | command | machine | from |", "|---|---|---|---|---|---|---|"]
    lines += [current_line(row, data["machines"]) for row in data["rows"]]
    lines.append("")
    lines.append("Machines: " + "; ".join(f"**{k}**: {v}" for k, v in data["machines"].items()) + ".")
    return "\n".join(lines)


def page_current_block(text: str) -> str:
    assert text.count(CURRENT_BEGIN) == 1 and text.count(CURRENT_END) == 1, "the current figures' markers"
    return text.split(CURRENT_BEGIN, 1)[1].split(CURRENT_END, 1)[0].strip("\n")


def test_the_current_figures_table_is_what_its_json_renders():
    rendered = render_current(json.loads(CURRENT.read_text()))
    assert page_current_block(BENCHMARKS.read_text()) == rendered, (
        "docs/benchmarks.md's current figures differ from docs/data/current.json: run python tests/test_docs.py")


def test_every_current_figure_says_where_it_came_from():
    data = json.loads(CURRENT.read_text())
    page, history = headings(BENCHMARKS), headings(HISTORY)
    assert len(data["rows"]) >= 20
    for row in data["rows"]:
        assert row["section"] in page, f"{row['what']}: no section #{row['section']} on the benchmarks page"
        if "from" in row:
            assert (REPO / row["from"]).is_file(), f"{row['what']}: no committed {row['from']}"
        else:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), f"{row['what']}: date {row['date']!r}"
            assert row["history"] in history, f"{row['what']}: no #{row['history']} in the history"
    with pytest.raises(AssertionError, match="no result row"):
        current_figure({"what": "x", "from": "docs/img/bench-vllm.json", "figure": "{a}",
                        "values": {"a": ["no such row", "value", ".2f"]}})
    with pytest.raises(AssertionError, match="no source"):
        current_figure({"what": "x", "figure": "1.0", "date": "2026-12-02", "source": "guessed"})


def test_the_benchmarks_page_opens_with_the_current_figures_and_stays_short():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) < 800
    sections = re.findall(r"^## (.+)$", FENCE.sub("", text), re.MULTILINE)
    assert sections[:2] == ["Current figures", "Charts"], sections
    assert text.index(CURRENT_BEGIN) < text.index("## Charts")


def test_every_bench_of_the_history_is_linked_from_the_benchmarks_page():
    text = BENCHMARKS.read_text()
    for name, level in headings(HISTORY).items():
        if level >= 2 and name != "measured":
            assert f"benchmarks-history.md#{name}" in text, f"no link to the history's #{name}"


def test_the_readme_measured_figures_are_the_benchmarks_pages():
    """Each row of the README's "Measured" table is backed by the entries of current.json
    that name it ("readme"), and every number of its "now" column is in their rows."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith("| ") and not r.startswith("| path ")]
    now = {cells[0].removeprefix("| "): cells[2] for cells in rows}
    assert len(now) >= 8
    data = json.loads(CURRENT.read_text())
    backing: dict[str, str] = {}
    for row in data["rows"]:
        if "readme" in row:
            assert row["readme"] in now, f"{row['what']}: no README Measured row {row['readme']!r}"
            backing[row["readme"]] = backing.get(row["readme"], "") + current_line(row, data["machines"])
    number = r"\d+(?:\.\d+)?"
    for label, figures in now.items():
        assert label in backing, f"README's Measured row {label!r}: no entry of docs/data/current.json names it"
        missing = [n for n in re.findall(number, figures) if n not in re.findall(number, backing[label])]
        assert not missing, f"README's Measured row {label!r}: {missing} not in its docs/data/current.json rows"


if __name__ == "__main__":  # rewrite the benchmarks page's table from docs/data/current.json
    page = BENCHMARKS.read_text()
    page_current_block(page)  # the markers are there, once each
    head, rest = page.split(CURRENT_BEGIN)
    tail = rest.split(CURRENT_END)[1]
    table = render_current(json.loads(CURRENT.read_text()))
    BENCHMARKS.write_text(f"{head}{CURRENT_BEGIN}\n{table}\n{CURRENT_END}{tail}")
    print(f"{BENCHMARKS.relative_to(REPO)}: current figures rendered from {CURRENT.relative_to(REPO)}")
