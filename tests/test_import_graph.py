"""No circular imports among ``inflight`` modules and the root ``bench/`` scripts, and no side
effects from importing an ``inflight`` module.

The graph is read from the source with ``ast``: a module-level ``import`` or ``from ... import``
of an ``inflight`` or ``bench`` module is an edge; imports inside functions (deferred on purpose) and under
``if TYPE_CHECKING:`` (types only) are not, except where a test says otherwise. Then every
module is imported alone, in a child forked from a parent that has imported the third-party
libraries ``inflight`` imports but no ``inflight`` module, and the child compares the process's
state before and after: threads, ``os.environ``, root-logger handlers and level, signal
handlers, atexit callbacks, ``sys.path`` and kopf's default registry.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "inflight"
STUDIES = ROOT / "bench"  # the experiments outside the package: in the graph, never shipped
# The one documented import side effect: ``inflight.runtime`` sets OMP_WAIT_POLICY=PASSIVE
# (when torch is not loaded yet) so the engine's OpenMP threads sleep instead of spinning.
ALLOWED_ENV = {"OMP_WAIT_POLICY"}
# The one module whose import registers kopf handlers: what ``kopf run -m`` loads.
KOPF_MAIN = "inflight.operator.kopf_main"


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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], deferred: bool, types: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module loads (and, with ``deferred``, those in functions;
    with ``types``, those under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if types or not _is_type_checking(node.test):
                found += _imports(node.body, deferred, types)
            found += _imports(node.orelse, deferred, types)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _imports(block, deferred, types)
        elif isinstance(node, (ast.With, ast.For, ast.While)) or (
                deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            found += _imports(node.body, deferred, types)
    return found


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
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
        nodes = _imports(ast.parse(path.read_text(), str(path)).body, deferred)
        graph[name] = frozenset(t for node in nodes for t in _targets(name, path, node, known)
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


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset()}) is None


def test_no_circular_imports_at_module_level() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "circular import: " + " -> ".join(cycle or [])


def test_no_circular_imports_even_deferred() -> None:
    """A deferred import inside a function is not an excuse for a circle, in the library or in
    the benchmarks (``inflight.bench`` and the root ``bench/`` studies) alike."""
    cycle = find_cycle(import_graph(deferred=True))
    assert cycle is None, "circular import through a deferred import: " + " -> ".join(cycle or [])


def test_package_never_imports_the_studies() -> None:
    """``bench/`` (studies, the GPU check, the compat runners) imports ``inflight``; nothing in
    ``inflight`` imports ``bench`` (it is not shipped in the wheel or the images)."""
    wrong = [f"{m} -> {t}" for m, ts in import_graph(deferred=True).items() if m.startswith("inflight")
             for t in ts if t == "bench" or t.startswith("bench.")]
    assert not wrong, wrong


def test_images_need_no_bench_code() -> None:
    """The Docker images leave ``inflight/bench`` out (docker/*.dockerignore), so nothing else in
    the package may import it, even deferred."""
    wrong = [f"{m} -> {t}" for m, ts in import_graph(deferred=True).items()
             if m.startswith("inflight.") and not m.startswith("inflight.bench")
             for t in ts if t.startswith("inflight.bench")]
    assert not wrong, wrong
    for ignore in sorted((ROOT / "docker").glob("*.dockerignore")):
        assert "inflight/bench/" in ignore.read_text().split(), f"{ignore.name} ships the bench suite"


# The rooms of ``inflight.runtime`` (docs/architecture.md has the map). The leaves are plain
# types a lower room may read from a higher one without depending on it: they import nothing
# from their own room at run time (checked below).
LEAVES = frozenset({"inflight.runtime.core.sched_output", "inflight.runtime.core.engine_types"})
# room -> rooms it never imports, at module level or deferred
NEVER = {
    "core": {"engine_core", "server", "cli", "demo"},
    "worker": {"core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "spec_decode": {"core", "engine_core", "server", "cli", "demo"},
    "model": {"worker", "core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "structured": {"worker", "core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "distributed": {"core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "engine_core": {"server", "cli", "demo"},
    "server": {"cli", "demo"},
    # LoRA adapters: files, host copies, device slots; reads the model's shapes, drives nothing above
    "lora": {"core", "worker", "spec_decode", "structured", "distributed", "engine_core", "server", "cli", "demo"},
    # KV events: what the block pool tells a router; the core drives it, it drives nothing
    "kv_events": {"core", "worker", "spec_decode", "model", "structured", "distributed", "engine_core", "server",
                  "cli", "demo"},
    # image input: pixels to patches, placeholders to tokens, the values a request carries; read by the
    # front end, the core and the worker, it reads none of them (nor the model: it imports no torch)
    "multimodal": {"core", "worker", "spec_decode", "model", "structured", "distributed", "engine_core", "server",
                   "cli", "demo", "lora", "kv_events"},
}


def room(module: str) -> str | None:
    """The room (subpackage of ``inflight.runtime``) ``module`` lives in, or None."""
    parts = module.split(".")
    is_package = module_paths()[module].name == "__init__.py"
    return parts[2] if parts[:2] == ["inflight", "runtime"] and len(parts) > (2 if is_package else 3) else None


def room_edges(deferred: bool) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the module edges behind it, leaves left out."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph(deferred).items():
        for target in targets:
            a, b = room(module), room(target)
            if a and b and a != b and target not in LEAVES:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "deferred-too"])
def test_runtime_rooms_are_layered(deferred: bool) -> None:
    """The rooms depend on each other in one direction only, at module level and through
    deferred imports alike (the leaves aside): the server drives the engine core, which drives
    the core, which drives the worker and the drafters, which run the model; the core never
    imports the engine core, the server or the CLI; the worker and the drafters read only the
    core's leaves; the model never imports the worker."""
    edges = room_edges(deferred)
    wrong = [e for (a, b), es in edges.items() if b in NEVER.get(a, ()) for e in es]
    assert not wrong, f"imports against the layers: {wrong}"
    cycle = find_cycle({a: frozenset(b for (x, b) in edges if x == a) for (a, _) in edges})
    assert cycle is None, f"rooms in a circle {cycle}: " + str(
        [e for (a, b), es in edges.items() if a in cycle and b in cycle for e in es])


def test_a_layer_rule_fails_when_broken() -> None:
    """The rules above are not vacuous: a made-up edge from the core to the server is caught."""
    edges = {**room_edges(True), ("core", "server"): ["inflight.runtime.core.x -> inflight.runtime.server.y"]}
    assert [e for (a, b), es in edges.items() if b in NEVER.get(a, ()) for e in es]


# room -> modules it never imports, not even deferred or for types (the device side gets plain chunks)
NEVER_EVEN_TYPES = {"worker": {"inflight.runtime.core.request"}, "spec_decode": {"inflight.runtime.core.request"}}


def imports_against_never_even_types(sources: dict[str, str]) -> list[str]:
    """``module -> source``: its imports (at any depth, types included) that ``NEVER_EVEN_TYPES`` forbids."""
    known, wrong = module_paths(), []
    for name, source in sources.items():
        banned = NEVER_EVEN_TYPES.get(room(name) or "", set())
        nodes = _imports(ast.parse(source).body, deferred=True, types=True)
        wrong += [f"{name} -> {t}" for n in nodes for t in _targets(name, known[name], n, known) if t in banned]
    return wrong


def test_the_device_side_never_imports_the_live_request() -> None:
    """The worker and the drafters read plain chunks (core/sched_output.py), never a ``Request``,
    not even as a type; a made-up import of it under ``TYPE_CHECKING`` is caught."""
    ours = {m: p.read_text() for m, p in module_paths().items() if m.startswith("inflight.") and room(m) in NEVER_EVEN_TYPES}
    assert not imports_against_never_even_types(ours)
    made_up = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from inflight.runtime.core import request\n"
    assert imports_against_never_even_types({"inflight.runtime.worker.batch_inputs": made_up})


def test_leaves_import_nothing_from_their_room() -> None:
    graph = import_graph(deferred=True)
    for leaf in LEAVES:
        same_room = [t for t in graph[leaf] if room(t) == room(leaf)]
        assert not same_room, f"{leaf} is a leaf but imports {same_room}"


def test_the_runtime_top_level_is_rooms_and_a_few_shared_modules() -> None:
    """About ten rooms and the vocabulary every room shares; a new module goes into a room."""
    top = sorted(p.name for p in (PACKAGE / "runtime").iterdir() if not p.name.startswith("__pycache__"))
    rooms = [n for n in top if (PACKAGE / "runtime" / n / "__init__.py").is_file() and n != "chat_templates"]
    shared = [n for n in top if n.endswith(".py") and n not in ("__init__.py", "__main__.py")]
    assert set(rooms) == set(NEVER) | {"cli", "demo"}, rooms
    assert len(shared) <= 10, f"{len(shared)} modules at the top of inflight/runtime: {shared}"


# -- importing each module alone ----------------------------------------------------------------

PROBE = r'''
import atexit, gc, importlib, json, logging, os, signal, sys, threading, traceback

request = json.loads(sys.stdin.read())
for statement in request["preload"]:  # the third-party libraries, so children import only ours
    try:
        exec(statement, {})
    except Exception:
        pass
try:
    import kopf
    registry = kopf.get_default_registry()
except ImportError:
    registry = None
gc.freeze()  # children share the preloaded objects' pages instead of copying them for the GC


def kopf_handlers():
    if registry is None:
        return 0
    return sum(len(getattr(r, "_handlers", ())) for r in vars(registry).values())


def signals():
    out = {}
    for sig in signal.valid_signals():
        try:
            out[getattr(sig, "name", str(sig))] = repr(signal.getsignal(sig))
        except (ValueError, OSError):
            pass
    return out


def snapshot():
    root = logging.getLogger()
    return {
        "threads": {t.ident: t.name for t in threading.enumerate()},
        "environ": dict(os.environ),
        "root_handlers": [repr(h) for h in root.handlers],
        "root_level": root.level,
        "signals": signals(),
        "atexit": atexit._ncallbacks(),
        "sys_path": list(sys.path),
        "kopf_handlers": kopf_handlers(),
    }


def changes(before, after):
    found = []
    new = [name for ident, name in after["threads"].items() if ident not in before["threads"]]
    if new:
        found.append(f"started threads {new}")
    for key in sorted(set(before["environ"]) | set(after["environ"])):
        if before["environ"].get(key) != after["environ"].get(key):
            found.append(f"env:{key}")
    for key in ("root_handlers", "root_level", "atexit", "sys_path", "kopf_handlers"):
        if before[key] != after[key]:
            found.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    for sig, handler in after["signals"].items():
        if before["signals"].get(sig) != handler:
            found.append(f"signal {sig} -> {handler}")
    return found


children = {}
for name in request["modules"]:
    children.setdefault(name.rpartition(".")[0], []).append(name)


def probe(names, at_once=3):
    """Import each of ``names`` in a child of this process (``at_once`` at a time); then its
    submodules in children of that child (importing ``a.b.c`` imports ``a.b`` first anyway, so
    this is the same as importing each alone, without paying for ``a.b`` again each time)."""
    running = set()
    for name in names:
        if len(running) >= at_once:
            running.discard(os.wait()[0])
        pid = os.fork()
        if pid:
            running.add(pid)
            continue
        try:
            before = snapshot()
            importlib.import_module(name)
            out = {"changes": changes(before, snapshot())}
        except ModuleNotFoundError as exc:
            out = {"missing": exc.name or str(exc)}
        except BaseException:
            out = {"error": traceback.format_exc()}
        with open(os.path.join(request["out"], name), "w") as f:
            json.dump(out, f)
        if "changes" in out:
            probe(children.get(name, []))
        os._exit(0)
    for pid in running:
        os.waitpid(pid, 0)


probe(children[""])
'''


def _modules_to_import() -> list[str]:
    return [m for m in module_paths() if m.startswith("inflight") and m.split(".")[-1] != "__main__"]


def _third_party_imports() -> list[str]:
    """Each distinct module-level import of a non-``inflight`` module, as a statement."""
    statements: set[str] = set()
    for name, path in module_paths().items():
        if not name.startswith("inflight"):
            continue
        for node in _imports(ast.parse(path.read_text()).body, deferred=False):
            if isinstance(node, ast.Import):
                statements |= {f"import {a.name}" for a in node.names if not a.name.startswith("inflight")}
            elif not node.level and node.module and node.module.split(".")[0] not in ("inflight", "__future__"):
                statements |= {f"from {node.module} import {a.name}" for a in node.names}
    return sorted(statements)


@pytest.fixture(scope="module")
def import_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Module -> ``{"changes": [...]}``, ``{"missing": dependency}`` or ``{"error": traceback}``."""
    if not hasattr(os, "fork"):
        pytest.skip("the import probe forks one child per module (POSIX only)")
    out = tmp_path_factory.mktemp("imports")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    modules = _modules_to_import()
    request = json.dumps({"preload": _third_party_imports(), "modules": modules, "out": str(out)})
    proc = subprocess.run([sys.executable, "-c", PROBE], input=request, capture_output=True, text=True,
                          cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, dict] = {}
    for name in sorted(modules, key=lambda m: m.count(".")):  # parents first: under a failed package, nothing ran
        path = out / name
        parent = results.get(name.rpartition(".")[0], {"changes": []})
        if path.exists():
            results[name] = json.loads(path.read_text())
        elif "changes" not in parent:
            results[name] = parent
        else:
            results[name] = {"error": "the probe's child died without a word (see stderr):\n" + proc.stderr[-2000:]}
    return results


@pytest.mark.parametrize("module", _modules_to_import())
def test_module_imports_alone_without_side_effects(module: str, import_results: dict[str, dict]) -> None:
    result = import_results[module]
    if "missing" in result:
        missing = result["missing"]
        if missing.split(".")[0] == "inflight":
            pytest.fail(f"{module} imports a module that does not exist: {missing}")
        pytest.skip(f"{module} needs the optional dependency {missing!r}, not installed here")
    assert "error" not in result, f"importing {module} alone failed:\n{result['error']}"
    changes = [c for c in result["changes"] if c.removeprefix("env:") not in ALLOWED_ENV]
    if module == KOPF_MAIN:
        changes = [c for c in changes if not c.startswith("kopf_handlers")]
    assert not changes, f"importing {module} has side effects: {changes}"


def test_kopf_main_is_the_one_that_registers(import_results: dict[str, dict]) -> None:
    result = import_results[KOPF_MAIN]
    if "missing" in result:
        pytest.skip(f"kopf is not installed ({result['missing']!r} missing)")
    assert any(c.startswith("kopf_handlers") for c in result["changes"]), result
