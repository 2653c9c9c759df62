"""Importing an ``inflight`` module has no side effects: every module is imported alone, in a child
forked from a parent that has imported the third-party libraries ``inflight`` imports but no
``inflight`` module, and the child compares the process's state before and after: threads,
``os.environ``, root-logger handlers and level, signal handlers, atexit callbacks, ``sys.path``
and kopf's default registry. (The import graph's own rules: tests/test_import_graph.py.)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.import_reading import ROOT, imports_in, module_paths

# The one documented import side effect: ``inflight.runtime`` sets OMP_WAIT_POLICY=PASSIVE
# (when torch is not loaded yet) so the engine's OpenMP threads sleep instead of spinning.
ALLOWED_ENV = {"OMP_WAIT_POLICY"}
# The one module whose import registers kopf handlers: what ``kopf run -m`` loads.
KOPF_MAIN = "inflight.operator.kopf_main"

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
        for node in imports_in(ast.parse(path.read_text()).body, deferred=False):
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
