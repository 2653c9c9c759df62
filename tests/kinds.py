"""Which tests are pure unit tests: the ``unit`` marker, given by a rule instead of a list.

A test is a unit test when neither its module nor any fixture it uses reaches, at module level,
for something that loads a model, starts a server or a process, or needs a cluster emulator:
transformers, triton, subprocess, multiprocessing, sockets, aiohttp, kopf, kmock, helm, the
Kubernetes and openai clients, or the ``inflight`` modules that build engines and servers
(:data:`HEAVY_INFLIGHT`). The rule reads imports with ``ast`` (``tests.*`` helpers followed
transitively), so a new pure test file is selected by ``make test-fast`` without anyone adding
it to a list, and a file that starts importing torch leaves the selection by itself.
``tests/test_kinds.py`` checks the rule against reality. Imports nothing from ``inflight``.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# torch alone is no reason (the suite's conftest imports it; small tensor maths is a unit test):
# what is heavy is a model, a compiler, a process, a socket or an emulator.
HEAVY_THIRD_PARTY = frozenset({
    "transformers", "triton", "subprocess", "multiprocessing", "socket", "aiohttp", "kopf", "kmock",
    "kubernetes", "openai", "pyhelm3", "helm",
})
# inflight modules that build an engine, a model or a server when a test uses them
HEAVY_INFLIGHT = (
    "inflight.runtime.core.engine", "inflight.runtime.llm", "inflight.runtime.model.loader", "inflight.runtime.demo.model",
    "inflight.runtime.worker.model_runner", "inflight.runtime.distributed.launcher",
    "inflight.runtime.distributed.worker", "inflight.runtime.server.app",
    "inflight.runtime.server.serve", "inflight.runtime.engine_core.core", "inflight.kernels.cpu_native",
    "inflight.operator.kopf_main", "inflight.operator.kube",
)

# Folders whose tests compile or interpret kernels, load the real model or start servers
# through fixtures that choose a backend at run time.
HEAVY_FOLDERS = {"kernels": "compiles or interprets kernels", "realmodel": "loads the real model",
                 "hostile": "attacks a live server"}


def _module_path(name: str, importer: Path) -> Path | None:
    """The file of test-side module ``name`` imported from ``importer``: ``tests.*`` from the
    repository root, a bare name (``conftest``, ``server_helpers``: pytest puts a test's folder on
    ``sys.path`` where it is no package) from the importer's folder; None for anything else."""
    parts = name.split(".")
    bases = [ROOT.joinpath(*parts)] if parts[0] == "tests" else [importer.parent.joinpath(*parts)]
    for base in bases:
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


def _top_level_imports(path: Path) -> list[str]:
    """Modules imported when ``path`` loads (function bodies and ``TYPE_CHECKING`` blocks aside)."""
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 1:  # a sibling: a bare name here
                names.extend([node.module] if node.module else [a.name for a in node.names])
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
                names.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
    visit(ast.parse(path.read_text(), str(path)).body)
    return names


@cache
def heavy_reason(path: Path) -> str | None:
    """Why the test, conftest or helper file ``path`` is not pure, or None when it is."""
    if path.is_relative_to(ROOT / "tests"):
        folder = path.relative_to(ROOT / "tests").parts[0]
        if folder in HEAVY_FOLDERS:
            return f"is in tests/{folder}, which {HEAVY_FOLDERS[folder]}"
    for name in _top_level_imports(path):
        top = name.split(".")[0]
        if top in HEAVY_THIRD_PARTY or any(name == h or name.startswith(h + ".") for h in HEAVY_INFLIGHT):
            return f"imports {name}"
        helper = _module_path(name, path)
        if helper is not None and helper != path:
            reason = heavy_reason(helper)
            if reason is not None:
                return f"{helper.relative_to(ROOT) if helper.is_relative_to(ROOT) else helper.name} {reason}"
    return None


def item_heavy_reason(path: Path, fixture_files: list[Path]) -> str | None:
    """Why a test in ``path`` that uses fixtures defined in ``fixture_files`` is not a unit
    test, or None when it is one."""
    reason = heavy_reason(path)
    if reason is not None:
        return reason
    for fixture_file in fixture_files:
        if fixture_file.is_relative_to(ROOT / "tests"):
            reason = heavy_reason(fixture_file)
            if reason is not None:
                return f"a fixture from {fixture_file.relative_to(ROOT)}, which {reason}"
    return None
