"""The start-up check of the NVIDIA driver against torch's CUDA build (issue 50), with fakes:
no GPU here. ``cuda_problem`` names the driver found and the minimum; ``resolve_device`` raises
it as the ``ValueError`` the engine core reports as its load failure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from inflight.runtime.worker import cuda_driver
from inflight.runtime.worker.cpu import device_setup
from inflight.runtime.worker.cuda_driver import CudaHost, cuda_problem, min_driver, parse_driver_version

DOCS = Path(__file__).resolve().parents[2] / "docs"

# A GPU node whose driver (575, CUDA 12.9) is too old for a CUDA 13.0 torch.
OLD_DRIVER = CudaHost(torch_version="2.13.0", torch_cuda="13.0", cuda_available=False,
                      driver_version="575.57.08", gpu_nodes=1, cuda_visible_devices=None)


def host(**changes: object) -> CudaHost:
    return dataclasses.replace(OLD_DRIVER, **changes)


@pytest.mark.parametrize("text", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  575.57.08  Sat May 24 07:21:14 UTC 2025\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n",
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder@U16-I3-B03-4-3)\n",
])
def test_the_driver_version_is_read_from_proc(text: str) -> None:
    assert parse_driver_version(text) == "575.57.08"


def test_no_version_in_unexpected_text() -> None:
    assert parse_driver_version("something else entirely 12") is None


@pytest.mark.parametrize(("cuda", "branch"), [("13.0", 580), ("13.2", 580), ("12.8", 525), ("11.8", 450),
                                               ("14.0", None)])
def test_minimum_driver_per_cuda_major(cuda: str, branch: int | None) -> None:
    assert min_driver(cuda) == branch


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_a_driver_too_old_names_found_and_minimum(device: str) -> None:
    problem = cuda_problem(device, OLD_DRIVER)
    assert problem is not None
    assert "575.57.08" in problem and ">= 580" in problem and "CUDA 13.0" in problem and "too old" in problem


def test_a_new_enough_driver_is_not_blamed() -> None:
    problem = cuda_problem("cuda", host(driver_version="580.65.06"))
    assert problem is not None and "too old" not in problem and "580.65.06" in problem
    assert "is_available() is False" in problem


def test_no_driver_at_all() -> None:
    problem = cuda_problem("cuda", host(driver_version=None, gpu_nodes=0))
    assert problem is not None and "no NVIDIA driver found" in problem and ">= 580" in problem


def test_a_driver_but_no_gpu_given_to_the_process() -> None:
    problem = cuda_problem("cuda", host(driver_version="590.10", gpu_nodes=0))
    assert problem is not None and "no GPU is given" in problem


def test_cuda_asked_of_a_cpu_build() -> None:
    problem = cuda_problem("cuda", host(torch_cuda=None, torch_version="2.13.0+cpu"))
    assert problem is not None and "CPU build" in problem


@pytest.mark.parametrize("changes", [
    {"cuda_available": True},  # CUDA works
    {"gpu_nodes": 0},  # a CPU pod on a GPU node: auto runs on the CPU
    {"torch_cuda": None},  # the CPU build installed on purpose
    {"cuda_visible_devices": ""},  # GPUs hidden on purpose
    {"cuda_visible_devices": "-1"},
])
def test_auto_without_a_gpu_of_its_own_runs_on_the_cpu(changes: dict[str, object]) -> None:
    assert cuda_problem("auto", host(**changes)) is None


def test_hidden_gpus_with_cuda_asked_for() -> None:
    problem = cuda_problem("cuda", host(cuda_visible_devices=""))
    assert problem is not None and "CUDA_VISIBLE_DEVICES" in problem


def test_cpu_and_sim_are_never_checked() -> None:
    assert cuda_problem("cpu", OLD_DRIVER) is None and cuda_problem("sim", OLD_DRIVER) is None


def test_resolve_device_raises_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_setup.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_setup, "read_cuda_host", lambda: OLD_DRIVER)
    for device in ("auto", "cuda"):
        with pytest.raises(ValueError, match=r"575\.57\.08 is too old.*>= 580"):
            device_setup.resolve_device(device)
    monkeypatch.setattr(device_setup, "read_cuda_host", lambda: host(gpu_nodes=0))
    assert device_setup.resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this machine's CPU-only torch")
def test_cuda_on_this_machine_says_why() -> None:
    with pytest.raises(ValueError, match="--device cuda"):
        device_setup.resolve_device("cuda")


def test_driver_version_falls_back_to_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 575.57.08\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cuda_driver.read_driver_version(tmp_path / "absent") == "575.57.08"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert cuda_driver.read_driver_version(tmp_path / "absent") is None


def test_gpu_nodes_are_counted(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert cuda_driver.count_gpu_nodes(tmp_path) == 2


def test_docs_state_the_minimum_the_check_uses() -> None:
    text = (DOCS / "gpu.md").read_text()
    assert f">= {min_driver('13.0')}" in text and "CUDA 13" in text
