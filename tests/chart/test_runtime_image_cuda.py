"""docker/runtime.Dockerfile's base image and its torch agree on CUDA (issue 50), read from the
file (it cannot be built here).

PyPI's torch 2.13.0 is a CUDA 13.0 build carrying its own CUDA libraries, so the base needs no
CUDA; a CUDA base image must at least be of torch's CUDA major (the old file paired a 12.8 base
with that torch). The torch pin is the Makefile's (scripts/install_torch.py); the image stops its
build if torch's ``torch.version.cuda`` is not the declared ``TORCH_CUDA``; the final stage
tells the NVIDIA container toolkit to refuse a driver older than that CUDA; docs/gpu.md states
the driver minimum the engine's start-up check uses.
"""

from __future__ import annotations

import ast
import re

import pytest
from chart_support import REPO

from inflight.runtime.worker.cuda_driver import min_driver

DOCKERFILE = REPO / "docker" / "runtime.Dockerfile"
CUDA_BASE = re.compile(r"^(?:[\w.-]+/)*nvidia/cuda:(\d+)\.(\d+)")


def base_problem(base: str, torch_cuda: str) -> str | None:
    """Why ``base`` does not suit a torch built for ``torch_cuda``, or None."""
    found = CUDA_BASE.match(base)
    if found is None:
        return None  # a plain base: the wheels carry CUDA, the node brings the driver
    if found.group(1) != torch_cuda.split(".")[0]:
        return f"{base} is a CUDA {found.group(1)}.{found.group(2)} base under a CUDA {torch_cuda} torch"
    return None


def _args_before_first_stage(text: str) -> dict[str, str]:
    head = text.split("\nFROM ", 1)[0]
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)\s*$", head, re.M))


def _stages(text: str) -> list[str]:
    return ["FROM " + part for part in text.split("\nFROM ")[1:]]


def _installer_torch_version() -> str:
    tree = ast.parse((REPO / "scripts" / "install_torch.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TORCH_VERSION"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("scripts/install_torch.py has no TORCH_VERSION")


@pytest.mark.parametrize(("base", "torch_cuda", "bad"), [
    ("nvidia/cuda:12.8.1-runtime-ubuntu24.04", "13.0", True),  # the image before issue 50
    ("nvcr.io/nvidia/cuda:12.9.0-base-ubuntu24.04", "13.0", True),
    ("nvidia/cuda:13.0.1-runtime-ubuntu24.04", "13.0", False),
    ("ubuntu:24.04", "13.0", False),
])
def test_the_base_rule(base: str, torch_cuda: str, bad: bool) -> None:
    assert (base_problem(base, torch_cuda) is not None) == bad


def test_base_and_torch_agree() -> None:
    text = DOCKERFILE.read_text()
    args = _args_before_first_stage(text)
    assert {"BASE_IMAGE", "TORCH_VERSION", "TORCH_CUDA"} <= set(args), args
    assert base_problem(args["BASE_IMAGE"], args["TORCH_CUDA"]) is None
    assert args["TORCH_VERSION"] == _installer_torch_version(), "the image pins another torch than the Makefile"
    build, final = _stages(text)
    assert build.startswith("FROM ${BASE_IMAGE} AS build") and final.startswith("FROM ${BASE_IMAGE}\n")
    # torch goes in first, at the pin, and the build checks its CUDA against TORCH_CUDA.
    installs = re.findall(r"pip install ([^\n]+)", build)
    assert installs[0].startswith('"torch==${TORCH_VERSION}"'), installs
    assert re.search(r"^ARG TORCH_VERSION$", build, re.M) and re.search(r"^ARG TORCH_CUDA$", build, re.M)
    assert "torch.version.cuda" in build and "'${TORCH_CUDA}'" in build
    # The final stage redeclares TORCH_CUDA (an ARG before FROM is empty inside a stage otherwise).
    assert re.search(r"^ARG TORCH_CUDA$", final, re.M)
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=${TORCH_CUDA}"' in final
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in final
    assert "NVIDIA_VISIBLE_DEVICES" not in text  # GPUs come from the pod's limit, never "all"


def test_the_docs_state_the_driver_for_the_images_cuda() -> None:
    torch_cuda = _args_before_first_stage(DOCKERFILE.read_text())["TORCH_CUDA"]
    gpu = (REPO / "docs" / "gpu.md").read_text()
    assert f"CUDA {torch_cuda}" in gpu and f">= {min_driver(torch_cuda)}" in gpu
    assert f">= {min_driver(torch_cuda)}" in (REPO / "docs" / "images.md").read_text()
