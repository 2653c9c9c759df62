"""Static checks of docker/*.Dockerfile (they cannot be built here): non-root users that match
the pods' securityContexts, the contract's entrypoints, and an operator image that carries
every third-party module the operator imports (and no torch)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from chart_support import REPO, one

DOCKER = REPO / "docker"
# Import name -> the distribution the operator image installs for it.
DISTRIBUTIONS = {
    "kopf": "kopf",
    "prometheus_client": "prometheus-client",
    "aiohttp": "aiohttp",
    "yaml": "pyyaml",
}


def _final_stage(name: str) -> str:
    text = (DOCKER / f"{name}.Dockerfile").read_text()
    return text.rsplit("\nFROM ", 1)[-1]


def _user(stage: str) -> tuple[int, int]:
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", stage, re.M)
    assert users, "the final stage must set USER uid:gid numerically (runAsNonRoot checks it)"
    uid, gid = users[-1]
    return int(uid), int(gid)


def _exec_form(stage: str, instruction: str) -> list[str]:
    (line,) = re.findall(rf"^{instruction}\s+(\[.*\])\s*$", stage, re.M)
    return list(ast.literal_eval(line))


def test_runtime_image() -> None:
    text = (DOCKER / "runtime.Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=ubuntu:[\w.-]+$", text, re.M)  # torch's wheels carry CUDA: test_runtime_image_cuda
    stage = _final_stage("runtime")
    assert stage.startswith("${BASE_IMAGE}")
    assert _exec_form(stage, "ENTRYPOINT") == ["inflight", "serve"]
    uid, _ = _user(stage)
    assert uid != 0
    try:
        from inflight.operator.pod_runtime import RUN_AS_USER
    except ImportError as err:
        pytest.fail(f"inflight.operator.pod_runtime.RUN_AS_USER is missing ({err})")
    assert uid == RUN_AS_USER, "the runtime image's user must be the uid the operator's pods run as"


def test_operator_image(objects) -> None:
    stage = _final_stage("operator")
    assert re.match(r"python:3\.\d+-slim", stage)
    assert _exec_form(stage, "ENTRYPOINT") == ["kopf", "run", "--module=inflight.operator.kopf_main"]
    pod = one(objects("defaults"), "Deployment")["spec"]["template"]["spec"]
    assert _user(stage) == (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"])
    assert "pip install --no-deps ." in stage
    assert "torch" not in stage


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    for candidate in (REPO.joinpath(*parts).with_suffix(".py"), REPO.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def _import_time_nodes(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements that run on import: module level and inside if/try/with/class, not in
    function bodies (lazy imports there are not needed to import the module)."""
    nodes: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes.append(stmt)
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(stmt, field, None) or []
            nodes += _import_time_nodes([c for c in children if isinstance(c, ast.stmt)])
            for handler in children:
                if isinstance(handler, ast.ExceptHandler):
                    nodes += _import_time_nodes(handler.body)
    return nodes


def _third_party_imports() -> dict[str, str]:
    """Top-level third-party modules imported by inflight.operator and what it imports from
    inflight, transitively -> the first file that imports each."""
    seen: set[Path] = set()
    todo = sorted((REPO / "inflight" / "operator").glob("*.py"))
    found: dict[str, str] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in _import_time_nodes(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "inflight":
                    if (target := _module_file(name)) is not None:
                        todo.append(target)
                    # Importing a subpackage runs its parents' __init__ too.
                    for depth in range(1, name.count(".") + 1):
                        if (parent := _module_file(".".join(name.split(".")[:depth]))) is not None:
                            todo.append(parent)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_operator_image_has_the_operators_imports() -> None:
    if len(list((REPO / "inflight" / "operator").glob("*.py"))) < 2:
        pytest.fail("inflight/operator/ has no modules yet: nothing to check the image against")
    imports = _third_party_imports()
    assert "torch" not in imports, f"the operator imports torch (via {imports.get('torch')}): the slim image has none"
    stage = _final_stage("operator")
    missing = {
        module: where
        for module, where in imports.items()
        if DISTRIBUTIONS.get(module, module) not in stage
    }
    assert missing == {}, f"docker/operator.Dockerfile does not install {missing}"


def test_importing_the_operator_does_not_import_torch() -> None:
    modules = sorted(
        f"inflight.operator.{p.stem}" for p in (REPO / "inflight" / "operator").glob("*.py")
        if p.stem != "__main__"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "heavy = sorted({'torch', 'transformers', 'triton', 'safetensors'} & set(sys.modules))\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", f"importing the operator loads {result.stdout.strip()}"
