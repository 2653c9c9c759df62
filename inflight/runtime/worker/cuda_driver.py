"""Why torch cannot use the GPU it was asked for: the NVIDIA driver against torch's CUDA build.

PyPI's torch carries its own CUDA (``torch.version.cuda``, with its ``nvidia-*`` wheels); the one
thing it takes from the machine is the kernel driver, which must be at least the minimum NVIDIA
states for that CUDA major (its CUDA minor-version compatibility table, docs/gpu.md). When CUDA is
asked for (``--device cuda``, or ``auto`` where a GPU is given to this process) and
``torch.cuda.is_available()`` is False, :func:`cuda_problem` says why in one line, naming the
driver found (``/proc/driver/nvidia/version``, else ``nvidia-smi``) and the minimum, instead of a
bare "no CUDA device" or, under ``auto``, a silent start on the CPU. :func:`read_cuda_host` reads
the machine; the rest are pure functions of what it read, tested with fakes. Knows nothing about
models or the engine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# CUDA major -> the oldest Linux driver branch that runs it (NVIDIA, "CUDA Compatibility",
# minor-version compatibility: CUDA 13.x >= 580, CUDA 12.x >= 525, CUDA 11.x >= 450).
MIN_DRIVER_BY_CUDA_MAJOR = {11: 450, 12: 525, 13: 580}
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
NVIDIA_SMI_TIMEOUT_S = 10.0
_DRIVER_IN_PROC = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")
_GPU_NODE = re.compile(r"nvidia\d+")


@dataclass(frozen=True, slots=True)
class CudaHost:
    """What the machine and torch say about CUDA."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: "13.0"; None for a CPU build
    cuda_available: bool  # torch.cuda.is_available()
    driver_version: str | None  # the NVIDIA kernel driver's, e.g. "580.65.06"; None: no driver found
    gpu_nodes: int  # /dev/nvidia<N> device nodes: GPUs given to this process (container)
    cuda_visible_devices: str | None  # the environment variable, as set (None: unset)


def min_driver(torch_cuda: str) -> int | None:
    """The oldest driver branch for a CUDA version ("13.0" -> 580), or None if not in the table."""
    major = torch_cuda.split(".", 1)[0]
    return MIN_DRIVER_BY_CUDA_MAJOR.get(int(major)) if major.isdigit() else None


def parse_driver_version(proc_text: str) -> str | None:
    """The version in ``/proc/driver/nvidia/version`` ("NVRM version: NVIDIA UNIX x86_64 Kernel
    Module  580.65.06  ..." or "... Open Kernel Module for x86_64  580.65.06 ...")."""
    found = _DRIVER_IN_PROC.search(proc_text)
    return found.group(1) if found else None


def driver_branch(version: str) -> int | None:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def cuda_problem(device: str, host: CudaHost) -> str | None:
    """Why ``device`` ("auto" or "cuda") cannot run on CUDA here, in one line a user can act on,
    or None: CUDA works, or ``auto`` has no GPU of its own to use (it runs on the CPU)."""
    if host.cuda_available or device not in ("auto", "cuda"):
        return None
    hidden = host.cuda_visible_devices is not None and host.cuda_visible_devices.strip() in ("", "-1")
    if device == "auto" and (host.torch_cuda is None or host.gpu_nodes == 0 or hidden):
        return None  # a CPU build, no GPU given to this process, or GPUs hidden on purpose
    run_on_cpu = "or run on the CPU with --device cpu"
    if host.torch_cuda is None:
        return (f"--device cuda: torch {host.torch_version} is a CPU build; install the CUDA build "
                f"(INFLIGHT_TORCH=cuda make install, or pip install torch from PyPI) {run_on_cpu}")
    build = f"torch {host.torch_version} is a CUDA {host.torch_cuda} build"
    minimum = min_driver(host.torch_cuda)
    needs = f"NVIDIA driver >= {minimum}" if minimum is not None else "an NVIDIA driver that supports it"
    if hidden:
        return (f"--device {device}: CUDA_VISIBLE_DEVICES={host.cuda_visible_devices!r} hides every GPU; "
                f"unset it {run_on_cpu}")
    if host.driver_version is None:
        return (f"--device {device}: no NVIDIA driver found (no {PROC_DRIVER_VERSION}, no nvidia-smi); {build} and "
                f"needs {needs} (docs/gpu.md). Give this process a GPU (on Kubernetes: a node with the driver "
                f"and a limit on nvidia.com/gpu) {run_on_cpu}")
    branch = driver_branch(host.driver_version)
    if minimum is not None and branch is not None and branch < minimum:
        return (f"--device {device}: NVIDIA driver {host.driver_version} is too old: {build} and needs "
                f"{needs} (docs/gpu.md). Upgrade the node's driver, use an image built on a torch for an "
                f"older CUDA, {run_on_cpu}")
    if host.gpu_nodes == 0:
        return (f"--device {device}: NVIDIA driver {host.driver_version} is loaded but no GPU is given to "
                f"this process (no /dev/nvidia<N>); on Kubernetes set a limit on nvidia.com/gpu, with docker "
                f"run --gpus, {run_on_cpu}")
    return (f"--device {device}: {build} and NVIDIA driver {host.driver_version} is loaded (the minimum is "
            f"{minimum if minimum is not None else 'unknown'}), yet torch.cuda.is_available() is False; "
            f"see torch's warning above and docs/gpu.md, {run_on_cpu}")


def read_driver_version(proc_file: Path = PROC_DRIVER_VERSION) -> str | None:
    """The loaded NVIDIA driver's version: ``/proc/driver/nvidia/version``, else ``nvidia-smi``."""
    try:
        version = parse_driver_version(proc_file.read_text(errors="replace"))
    except OSError:
        version = None
    if version is not None:
        return version
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""
    return first if re.fullmatch(r"\d+(?:\.\d+)+", first) else None


def count_gpu_nodes(dev: Path = Path("/dev")) -> int:
    try:
        return sum(1 for entry in dev.iterdir() if _GPU_NODE.fullmatch(entry.name))
    except OSError:
        return 0


def read_cuda_host() -> CudaHost:
    """This machine, as torch and the driver see it."""
    import torch

    available = torch.cuda.is_available()
    return CudaHost(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=available,
        driver_version=None if available else read_driver_version(),
        gpu_nodes=count_gpu_nodes(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
