"""Install torch into a Python environment: the CPU build without a GPU, the CUDA build with one.

    python scripts/install_torch.py [--python PY] [--dry-run] [-- EXTRA PIP ARGS]

What it does (the Makefile's first install step; ``make run`` and ``make test`` call it):

* **Which build.** ``INFLIGHT_TORCH`` = ``auto`` (default), ``cpu`` or ``cuda``. ``auto`` looks for
  an NVIDIA GPU: ``/proc/driver/nvidia/gpus`` holds an entry, or ``nvidia-smi -L`` lists one.
* **CPU build**: ``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``
  (PyTorch's own CPU wheel index, ``INFLIGHT_TORCH_CPU_INDEX`` to change it). If that index
  cannot be reached (checked first, 10 s at most) or pip fails against it, it falls back to a
  plain ``pip install torch==2.13.0`` from pip's configured index (PyPI unless configured
  otherwise) and says so loudly, since on Linux x86_64 PyPI's torch is the CUDA build (several
  GB with its ``nvidia-*`` wheels; it runs on the CPU all the same).
* **CUDA build**: a plain ``pip install torch==2.13.0`` (PyPI's Linux x86_64 build is CUDA's).
* Afterwards it imports torch in that environment and prints ``torch.__version__`` and
  ``torch.version.cuda``: what was really installed, whichever way it came. Nothing is done
  when the wanted version and build are already there.
* ``--dry-run``: pip resolves (``--dry-run --ignore-installed --report``) and nothing is
  installed; it prints the build pip would pick, the index it came from and every package.

Only the standard library: it runs before anything else is installed. Knows nothing of inflight.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TORCH_VERSION = "2.13.0"
CPU_INDEX_URL = "https://download.pytorch.org/whl/cpu"
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
MODES = ("auto", "cpu", "cuda")
PROBE_TIMEOUT_S = 10.0
PYPI = "pip's configured index (PyPI unless configured otherwise)"


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """Whether an NVIDIA GPU is present, and what showed it (or what was looked at)."""

    found: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Choice:
    """The torch build to install and why."""

    build: str  # "cpu" | "cuda"
    reason: str


@dataclass(frozen=True, slots=True)
class Installed:
    """A torch as it imports: its version and ``torch.version.cuda`` (None for a CPU build)."""

    version: str
    cuda: str | None

    @property
    def build(self) -> str:
        return "cpu" if self.cuda is None else "cuda"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a ``pip install --dry-run --report`` would install."""

    torch_version: str | None
    torch_url: str | None
    cuda_packages: tuple[str, ...]  # nvidia-* and cuda-* wheels pulled in with torch
    packages: tuple[str, ...]  # every "name==version"

    @property
    def build(self) -> str:
        if self.torch_version is None:
            return "none"
        return "cuda" if self.cuda_packages or "+cu" in self.torch_version else "cpu"


def detect_gpu(proc_gpus: Path = PROC_GPUS, nvidia_smi: str | None = None) -> GpuProbe:
    """An NVIDIA GPU if the driver lists one under ``proc_gpus`` or ``nvidia-smi -L`` names one."""
    if proc_gpus.is_dir() and any(proc_gpus.iterdir()):
        return GpuProbe(True, f"{len(list(proc_gpus.iterdir()))} GPU(s) under {proc_gpus}")
    smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return GpuProbe(False, f"{smi} -L failed ({exc})")
        gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
        if gpus:
            return GpuProbe(True, f"nvidia-smi -L: {gpus[0].strip()}" + (f" (+{len(gpus) - 1})" if len(gpus) > 1 else ""))
        return GpuProbe(False, f"{smi} -L lists no GPU")
    return GpuProbe(False, f"no nvidia-smi on PATH and nothing under {proc_gpus}")


def choose_build(mode: str, probe: GpuProbe | None) -> Choice:
    """The build for ``mode`` (``INFLIGHT_TORCH``); ``auto`` needs the GPU probe."""
    if mode not in MODES:
        raise ValueError(f"INFLIGHT_TORCH must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != "auto":
        return Choice(mode, f"INFLIGHT_TORCH={mode}")
    if probe is None:
        raise ValueError("INFLIGHT_TORCH=auto needs a GPU probe")
    return Choice("cuda" if probe.found else "cpu", ("GPU found: " if probe.found else "no GPU: ") + probe.reason)


def index_unreachable(index_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``index_url``'s torch page cannot be fetched, or None when it can."""
    url = index_url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read(1024)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"
    return None


def pip_command(python: str, index_url: str | None, report: Path | None, extra: list[str]) -> list[str]:
    """``pip install torch==VERSION``, against ``index_url`` (None: pip's own), dry-run with a report."""
    cmd = [python, "-m", "pip", "install", f"torch=={TORCH_VERSION}"]
    if index_url is not None:
        cmd += ["--index-url", index_url]
    if report is not None:
        cmd += ["--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
    return cmd + extra


def installed_torch(python: str) -> Installed | None:
    """The torch that ``python`` imports, or None when it has none (or it does not import)."""
    code = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return None
    version, cuda = json.loads(proc.stdout.strip().splitlines()[-1])
    return Installed(version, cuda)


def read_plan(report: dict) -> Plan:
    """What pip's ``--report`` JSON says it would install."""
    torch_version = torch_url = None
    cuda, packages = [], []
    for item in report.get("install", []):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        packages.append(f"{name}=={version}")
        if name.lower() == "torch":
            torch_version, torch_url = version, item.get("download_info", {}).get("url")
        elif name.lower().startswith(("nvidia-", "nvidia_", "cuda-", "cuda_")):
            cuda.append(name)
    return Plan(torch_version, torch_url, tuple(sorted(cuda)), tuple(packages))


def describe_installed(got: Installed) -> str:
    build = "CPU build" if got.build == "cpu" else f"CUDA build (CUDA {got.cuda})"
    return f"torch {got.version}: {build}; torch.version.cuda = {got.cuda!r}"


def describe_plan(plan: Plan) -> str:
    if plan.torch_version is None:
        return "pip would install no torch (already satisfied?)"
    build = (f"CUDA build (+{len(plan.cuda_packages)} nvidia-*/cuda-* wheels)" if plan.build == "cuda"
             else "CPU build (no nvidia-* wheels)")
    return (f"pip would install torch {plan.torch_version}: {build}, {len(plan.packages)} packages in all,"
            f" torch from {plan.torch_url}")


def _loud(lines: list[str]) -> None:
    bar = "!" * 78
    print("\n".join([bar, *(f"!! {line}" for line in lines), bar]), flush=True)


def _run_pip(python: str, index_url: str | None, dry_run: bool, extra: list[str]) -> tuple[int, Plan | None]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json" if dry_run else None
        cmd = pip_command(python, index_url, report, extra)
        print("$ " + " ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        plan = read_plan(json.loads(report.read_text())) if report and rc == 0 and report.is_file() else None
    return rc, plan


def install(python: str, choice: Choice, cpu_index: str, dry_run: bool, extra: list[str]) -> int:
    """Run pip as the choice says, with the CPU index's fallback; print what came of it."""
    index: str | None = cpu_index if choice.build == "cpu" else None
    if index is not None:
        why = index_unreachable(index)
        if why is not None:
            _loud([f"PyTorch's CPU wheel index cannot be reached: {why}",
                   f"falling back to {PYPI}: on Linux x86_64 that is the CUDA build of torch",
                   "(several GB with its nvidia-* wheels; it runs on the CPU all the same)."])
            index = None
    rc, plan = _run_pip(python, index, dry_run, extra)
    if rc != 0 and index is not None:
        _loud([f"pip failed against {index} (exit {rc}); falling back to {PYPI}."])
        index = None
        rc, plan = _run_pip(python, index, dry_run, extra)
    source = index or PYPI
    if rc != 0:
        _loud([f"pip install torch=={TORCH_VERSION} failed (exit {rc}) from {source}."])
        return rc
    if dry_run:
        print(f"== dry run, from {source}: " + (describe_plan(plan) if plan else "no report") + " ==")
        if plan:
            print("   " + " ".join(plan.packages))
        return 0
    got = installed_torch(python)
    if got is None:
        _loud([f"pip succeeded but {python} cannot import torch."])
        return 1
    print(f"== installed {describe_installed(got)} (from {source}) ==", flush=True)
    if got.build != choice.build:
        _loud([f"wanted the {choice.build.upper()} build ({choice.reason}) but got the {got.build.upper()} build.",
               *(["To switch to the CPU build later: " + " ".join(
                   pip_command(python, cpu_index, None, ["--force-reinstall", "--no-deps"]))]
                 if choice.build == "cpu" else [])])
    return 0


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1:]
    parser = argparse.ArgumentParser(prog="scripts/install_torch.py", description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's python (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="resolve and report, install nothing")
    parser.add_argument("--cpu-index-url", default=os.environ.get("INFLIGHT_TORCH_CPU_INDEX", CPU_INDEX_URL))
    args = parser.parse_args(args_in)
    mode = os.environ.get("INFLIGHT_TORCH", "auto").strip().lower() or "auto"
    try:
        choice = choose_build(mode, detect_gpu() if mode == "auto" else None)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"== torch {TORCH_VERSION}: the {choice.build.upper()} build ({choice.reason};"
          " INFLIGHT_TORCH=cpu|cuda overrides) ==", flush=True)
    if not args.dry_run:
        have = installed_torch(args.python)
        if have is not None and have.version.split("+")[0] == TORCH_VERSION and have.build == choice.build:
            print(f"== already installed: {describe_installed(have)} ==")
            return 0
    return install(args.python, choice, args.cpu_index_url, args.dry_run, extra)


if __name__ == "__main__":
    sys.exit(main())
