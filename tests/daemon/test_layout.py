"""hicache/daemon/ is split by concern (its __init__ says which package owns what): imports
flowing down serve > hybrid > movers > ingest > core, each package saying what it owns.
The rules for the whole package (no import cycle, modules of at most 500 lines, every
__init__ naming its modules) are tests/test_layout.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache.daemon
from tests.test_portable_imports import import_graph

DAEMON = Path(hicache.daemon.__file__).parent
ORDER = ["serve", "hybrid", "movers", "ingest", "core"]  # a package imports only those after it
# The engine cycle plans its backups through the ingest protocol, which needs only core's records.
UPWARD_OK = {("hicache.daemon.core.service", "hicache.daemon.ingest.backups"),
             ("hicache.daemon.core.service", "hicache.daemon.ingest.protocol")}


def daemon_graph() -> dict[str, set[str]]:
    return {m: deps for m, deps in import_graph().items() if m.startswith("hicache.daemon")}


def test_sub_packages_import_downwards_only():
    bad = []
    for mod, deps in daemon_graph().items():
        parts = mod.split(".")
        if len(parts) < 4:
            continue
        for dep in deps:
            dparts = dep.split(".")
            if dep.startswith("hicache.daemon.") and len(dparts) >= 4 and dparts[2] != parts[2]:
                if ORDER.index(dparts[2]) < ORDER.index(parts[2]) and (mod, dep) not in UPWARD_OK:
                    bad.append((mod, dep))
    assert not bad, bad


def test_the_split_is_what_the_daemon_docstring_says():
    packages = sorted(p.name for p in DAEMON.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(ORDER)
    assert not [p.name for p in DAEMON.glob("*.py") if p.name != "__init__.py"]  # every module has a room
    top = ast.get_docstring(ast.parse((DAEMON / "__init__.py").read_text()))
    for name in ORDER:
        doc = ast.get_docstring(ast.parse((DAEMON / name / "__init__.py").read_text()))
        assert doc, f"hicache/daemon/{name}/__init__.py says nothing of what it owns"
        assert f"{name}/" in top
        for module in (DAEMON / name).glob("*.py"):
            if module.name != "__init__.py":
                assert module.name in doc, f"{name}/__init__.py does not name {module.name}"

