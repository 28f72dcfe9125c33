"""The package's layout keeps to the project's rules, for a newcomer finding their way in:

- no hicache module imports one that imports it back, however indirectly;
- imports flow down between the top-level packages, in the order ORDER declares below;
- every package's __init__ docstring names each of its modules and sub-packages;
- modules of at most 500 lines, folders of at most 20 modules, at most 8 loose at the root;
- docs/design.md's "Layout of the code" table names every package, and every path it
  names exists.

Every import statement counts (tests/test_portable_imports.py's `import_graph`): those inside
functions and under `if TYPE_CHECKING:` too. They make no cycle at import time, but still tie
two modules both ways for a reader and a type checker; a module that needs another's type
without importing it names it through a `typing.Protocol` (rpc/connection.py's
`ConnectionOwner`). tests/daemon/test_layout.py keeps the daemon's own order of sub-packages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hicache
from tests.test_portable_imports import cycle_through, import_graph

PACKAGE = Path(hicache.__file__).parent
REPO = PACKAGE.parent
DESIGN = REPO / "docs" / "design.md"

# The top-level packages and root modules (hicache.X), from the top down: each may import only
# those of a later line. Names on one line are peers that import none of each other. Derived
# from the graph as it is; a new package gets its line here on purpose.
ORDER = [
    ("cli",),  # the command line: runs the daemon, the benches, the admin commands
    ("bench",),  # benchmarks: drive daemons, engines, tiers and the RPC path
    ("daemon", "integrations", "engine"),  # the daemon process; the engines' side of the socket
    ("client", "portable", "systemd", "progress"),  # what the daemon and engines build on
    ("rpc", "transfer", "config"),  # the wire; device <-> host copies; configuration
    ("tiers",),  # device pool, host arena, disk, remote stores
    ("index",),  # what the daemon knows of each namespace's pages
    ("kernels",),  # copy kernels and the native modules' loader
    ("hicache", "state_layout", "cpu_list"),  # the package root (`__version__`); shared geometry
    ("layout",),
    ("errors",),  # the error tree: imported by all, imports nothing of hicache
]
# Imports against ORDER, allowed one by one: (importer, imported module) -> why. None today.
UPWARD_OK: dict[tuple[str, str], str] = {}

MAX_LINES = 500
MAX_FOLDER_MODULES = 20
MAX_ROOT_MODULES = 8


def unit(module: str) -> str:
    """The top-level package or root module a module belongs to (`hicache` for the root's __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def rank() -> dict[str, int]:
    return {name: i for i, names in enumerate(ORDER) for name in names}


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def order_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    ranks = rank()
    return sorted((mod, dep) for mod, deps in graph.items() for dep in deps
                  if unit(mod) != unit(dep) and ranks[unit(mod)] >= ranks[unit(dep)]
                  and (mod, dep) not in UPWARD_OK)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 200  # the walk sees the whole package
    cycles = {m: c for m in sorted(graph) if (c := cycle_through(graph, m))}
    assert not cycles, cycles


def test_order_names_each_top_level_package_and_root_module_once():
    names = [name for names in ORDER for name in names]
    assert len(names) == len(set(names))
    top = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    top |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {"hicache"}
    top.discard("data")  # package data only: no module imports it
    assert set(names) == top
    assert not [k for k in UPWARD_OK if k[0] not in import_graph() or k[1] not in import_graph()[k[0]]]


def test_imports_flow_down_between_top_level_packages():
    graph = import_graph()
    assert "hicache.rpc.connection" in graph["hicache.rpc.server"]  # the walk sees real edges
    assert order_violations(graph) == []


def test_the_order_check_sees_an_upward_import_and_a_peer_import():
    graph = {"hicache.tiers.disk.tier": {"hicache.daemon.core.records", "hicache.errors"},
             "hicache.rpc.server": {"hicache.transfer.executor"}, "hicache.cli.main": {"hicache.bench.cli"}}
    assert order_violations(graph) == [("hicache.rpc.server", "hicache.transfer.executor"),
                                       ("hicache.tiers.disk.tier", "hicache.daemon.core.records")]


def test_every_package_docstring_names_its_modules_and_sub_packages():
    missing = {}
    for pkg in packages():
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        names = [m.name for m in pkg.glob("*.py") if m.name != "__init__.py"]
        names += [f"{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").exists()]
        if not doc or (lost := [n for n in sorted(names) if not re.search(rf"(?<![\w/]){re.escape(n)}", doc)]):
            missing[str(pkg.relative_to(REPO))] = lost if doc else "no docstring"
    assert not missing, missing


def test_modules_stay_readable():
    long = {str(p.relative_to(REPO)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_folders_stay_small_and_the_root_holds_few_modules():
    big = {str(pkg.relative_to(REPO)): n for pkg in packages()
           if (n := len([m for m in pkg.glob("*.py") if m.name != "__init__.py"])) > MAX_FOLDER_MODULES}
    assert not big, big
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, root


# -- docs/design.md's "Layout of the code" -----------------------------------------------------

FILE_NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|c|h))(?![\w.])")
FOLDER_NAME = re.compile(r"(?<![\w./`-])((?:[\w-]+/)*[\w-]+)/(?![\w/])")


def layout_table(text: str) -> dict[str, str]:
    """The table's entries: path (a sub-entry under the entry above it) -> its text."""
    section = text.split("## Layout of the code", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.DOTALL).group(1)
    entries: dict[str, str] = {}
    parent = head = ""
    for line in block.splitlines():
        if line[:1].strip():  # a top entry
            head, _, rest = line.partition(" ")
            parent = head
        elif line.startswith("  ") and line[2:3].strip():  # a sub-entry of the one above
            name, _, rest = line.strip().partition(" ")
            head = parent + name
        else:
            rest = line
        entries[head] = (entries.get(head, "") + " " + rest.strip()).strip()
    return entries


def table_problems(entries: dict[str, str], repo: Path = REPO) -> list[str]:
    problems = []
    for head, text in entries.items():
        where = repo / head
        if not where.exists():
            problems.append(f"{head}: no such path")
            continue
        folder = where if where.is_dir() else where.parent
        for name in FILE_NAME.findall(text):
            if not (folder / name).exists() and not any(folder.rglob(name)) and not (repo / name).exists():
                problems.append(f"{head}: names {name}, not under {folder.relative_to(repo)}")
        for name in FOLDER_NAME.findall(text):
            if not (folder / name).is_dir() and not any(p.is_dir() for p in folder.rglob(name)):
                problems.append(f"{head}: names {name}/, not under {folder.relative_to(repo)}")
    tops = {p.relative_to(repo).as_posix() + "/" for p in (repo / "hicache").iterdir() if (p / "__init__.py").exists()}
    tops |= {p.relative_to(repo).as_posix() for p in (repo / "hicache").glob("*.py") if p.name != "__init__.py"}
    problems += [f"{top}: no entry" for top in sorted(tops - set(entries))]
    for pkg in sorted((repo / "hicache").rglob("__init__.py")):
        rel = pkg.parent.relative_to(repo / "hicache").parts
        if len(rel) < 2:
            continue
        top = f"hicache/{rel[0]}/"
        said = " ".join(text for head, text in entries.items() if head.startswith(top))
        if f"hicache/{'/'.join(rel)}/" not in entries and not re.search(rf"(?<![\w-]){rel[-1]}/", said):
            problems.append(f"{'/'.join(rel)}/: not named in {top}'s entry")
    return problems


def test_the_design_layout_table_is_the_package():
    entries = layout_table(DESIGN.read_text())
    assert "hicache/daemon/serve/" in entries and "hicache/tiers/" in entries  # the parse sees the table
    assert table_problems(entries) == []


def test_the_table_check_sees_a_missing_package_and_a_stale_path(tmp_path):
    for rel in ("hicache/a/b", "hicache/c"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "__init__.py").write_text("")
    (tmp_path / "hicache/a/x.py").write_text("")
    page = ("## Layout of the code\n\n```text\nhicache/a/     b/ and x.py, y.py\n"
            "  gone/       z.c\nhicache/old.py  stale\n```\n")
    assert table_problems(layout_table(page), tmp_path) == [
        "hicache/a/: names y.py, not under hicache/a",
        "hicache/a/gone/: no such path",
        "hicache/old.py: no such path",
        "hicache/c/: no entry",
    ]
