"""Imports among the daemon's app, handlers and portable modules flow one way.

Every import statement counts, TYPE_CHECKING-only and function-local ones too: a cycle
there still ties the modules together for readers and type checkers.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import hicache

PACKAGE = Path(hicache.__file__).parent
ONE_WAY = ("hicache.daemon.serve.app", "hicache.daemon.serve.handlers", "hicache.daemon.serve.portable")


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the hicache modules it imports (anywhere in its source)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import cycle from `start` back to it, or None (breadth first)."""
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        mod = queue.popleft()
        for dep in sorted(graph.get(mod, ())):
            if dep == start:
                return [*paths[mod], start]
            if dep not in paths:
                paths[dep] = [*paths[mod], dep]
                queue.append(dep)
    return None


def test_the_walk_sees_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None


def test_app_handlers_portable_import_one_way():
    graph = import_graph()
    assert "hicache.daemon.serve.portable" in graph["hicache.daemon.serve.handlers"]  # the walk sees real edges
    assert "hicache.daemon.serve.handlers" in graph["hicache.daemon.serve.app"]
    assert {m: cycle_through(graph, m) for m in ONE_WAY} == dict.fromkeys(ONE_WAY)


def test_the_daemon_is_what_the_handlers_take():
    from hicache.config import Config
    from hicache.daemon.serve.app import Daemon
    from hicache.daemon.serve.context import DaemonContext

    assert isinstance(Daemon(Config()), DaemonContext)  # every member the protocol names (no tier started)
