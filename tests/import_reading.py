"""Reading ``inflight``'s and the root ``bench/`` scripts' imports from the source, with ``ast``,
for the import tests (tests/test_import_graph.py, tests/test_import_side_effects.py).

A module-level ``import`` or ``from ... import`` of an ``inflight`` or ``bench`` module is an edge;
imports inside functions (deferred on purpose) and under ``if TYPE_CHECKING:`` (types only) are
not, unless asked for. Imports nothing from ``inflight``.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "inflight"
STUDIES = ROOT / "bench"  # the experiments outside the package: in the graph, never shipped


@cache
def module_paths() -> dict[str, Path]:
    """Every module under ``inflight/`` and ``bench/``, by dotted name (a package by its ``__init__``)."""
    paths = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *STUDIES.rglob("*.py")]):
        if ".work" in path.parts:  # the peers' installs under bench/.work
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(parts)] = path
    return paths


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_in(body: list[ast.stmt], deferred: bool, types: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module loads (and, with ``deferred``, those in functions;
    with ``types``, those under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if types or not is_type_checking(node.test):
                found += imports_in(node.body, deferred, types)
            found += imports_in(node.orelse, deferred, types)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += imports_in(block, deferred, types)
        elif isinstance(node, (ast.With, ast.For, ast.While)) or (
                deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            found += imports_in(node.body, deferred, types)
    return found


def targets_of(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        module = ".".join(package[: len(package) - node.level + 1] + ([module] if module else []))
    # ``from pkg import sub`` imports the submodule ``pkg.sub``; ``from mod import name`` imports mod
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]


@cache
def import_graph(deferred: bool = False) -> dict[str, frozenset[str]]:
    """Module -> the ``inflight`` modules it imports (see module docstring)."""
    known = module_paths()
    graph = {}
    for name, path in known.items():
        nodes = imports_in(ast.parse(path.read_text(), str(path)).body, deferred)
        graph[name] = frozenset(t for node in nodes for t in targets_of(name, path, node, known)
                                if t in known and t != name)
    return graph


def find_cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None when it has none (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None
