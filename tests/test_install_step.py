"""The torch install step (``scripts/install_torch.py``, the Makefile's first step).

GPU detection is simulated with fake ``/proc/driver/nvidia/gpus`` folders and a fake
``nvidia-smi``; pip runs for real but only in ``--dry-run`` mode, against a fake ``torch``
wheel on 127.0.0.1 or in a local folder, with every pip setting of this machine shut out
(``PIP_CONFIG_FILE`` = the null device), so nothing here reaches a network or installs anything.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_torch.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


it = _load_script()


# ---- detection and choice ------------------------------------------------------------------

def _fake_smi(tmp_path: Path, output: str) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    smi.chmod(0o755)
    return str(smi)


def test_a_driver_entry_under_proc_is_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "0000:01:00.0").mkdir()
    probe = it.detect_gpu(proc_gpus=tmp_path, nvidia_smi="")
    assert probe.found and "1 GPU(s)" in probe.reason


def test_nvidia_smi_listing_a_gpu_is_a_gpu(tmp_path: Path) -> None:
    smi = _fake_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)\nGPU 1: NVIDIA H100 (UUID: GPU-5678)")
    probe = it.detect_gpu(proc_gpus=tmp_path / "missing", nvidia_smi=smi)
    assert probe.found and "NVIDIA H100 80GB HBM3" in probe.reason and "(+1)" in probe.reason


@pytest.mark.parametrize("output", ["No devices were found", "NVIDIA-SMI has failed because it couldn't communicate"])
def test_nvidia_smi_without_a_gpu_is_no_gpu(tmp_path: Path, output: str) -> None:
    probe = it.detect_gpu(proc_gpus=tmp_path / "missing", nvidia_smi=_fake_smi(tmp_path, output))
    assert not probe.found and "lists no GPU" in probe.reason


def test_nothing_at_all_is_no_gpu(tmp_path: Path) -> None:
    (tmp_path / "gpus").mkdir()  # the driver folder with no GPU in it
    probe = it.detect_gpu(proc_gpus=tmp_path / "gpus", nvidia_smi="")
    assert not probe.found and "no nvidia-smi" in probe.reason


def test_choice_follows_the_probe_unless_overridden() -> None:
    gpu, none = it.GpuProbe(True, "nvidia-smi -L: GPU 0"), it.GpuProbe(False, "nothing")
    assert it.choose_build("auto", gpu).build == "cuda"
    assert it.choose_build("auto", none).build == "cpu"
    assert it.choose_build("cpu", None) == it.Choice("cpu", "INFLIGHT_TORCH=cpu")
    assert it.choose_build("cuda", None).build == "cuda"
    with pytest.raises(ValueError, match="INFLIGHT_TORCH must be one of auto, cpu, cuda, not 'rocm'"):
        it.choose_build("rocm", None)


def test_pip_command_lines() -> None:
    assert it.pip_command("py", it.CPU_INDEX_URL, None, []) == [
        "py", "-m", "pip", "install", "torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    dry = it.pip_command("py", None, Path("r.json"), ["--isolated"])
    assert "--index-url" not in dry and dry[-6:] == ["--dry-run", "--ignore-installed", "--quiet", "--report",
                                                     "r.json", "--isolated"]


def test_plan_from_a_pip_report() -> None:
    def item(name: str, version: str, url: str = "https://files/x.whl") -> dict:
        return {"metadata": {"name": name, "version": version}, "download_info": {"url": url}}

    cuda = it.read_plan({"install": [item("torch", "2.13.0"), item("nvidia-cublas", "13.1"),
                                     item("cuda-bindings", "13.5"), item("sympy", "1.14")]})
    assert cuda.build == "cuda" and cuda.cuda_packages == ("cuda-bindings", "nvidia-cublas")
    cpu = it.read_plan({"install": [item("torch", "2.13.0+cpu"), item("sympy", "1.14")]})
    assert cpu.build == "cpu" and "CPU build" in it.describe_plan(cpu)
    assert it.read_plan({"install": []}).build == "none"


# ---- pip for real, dry-run, offline ---------------------------------------------------------

def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal valid wheel: enough for pip to resolve it."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Index:
    """A PEP 503 index on 127.0.0.1 (http.server's directory listings) that records its requests."""

    def __init__(self, root: Path) -> None:
        self.paths: list[str] = []
        paths = self.paths

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                paths.append(self.path)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __enter__(self) -> _Index:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _run(mode: str, cpu_index: str, pip_env: dict[str, str], *pip_args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_RETRIES="0",
               PIP_TIMEOUT="10", INFLIGHT_TORCH=mode, **pip_env)
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--cpu-index-url", cpu_index, "--", *pip_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def pypi_folder(tmp_path: Path) -> Path:
    """Stands in for PyPI: PyPI's torch 2.13.0, the CUDA build (it pulls an nvidia-* wheel)."""
    folder = tmp_path / "pypi"
    folder.mkdir()
    _wheel(folder, "torch", "2.13.0", requires=("nvidia-cublas==13.1.1.3",))
    _wheel(folder, "nvidia-cublas", "13.1.1.3")
    return folder


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[_Index]:
    """Stands in for PyTorch's CPU wheel index: torch 2.13.0+cpu, no nvidia-* wheels."""
    root = tmp_path / "whl-cpu"
    (root / "torch").mkdir(parents=True)
    _wheel(root / "torch", "torch", "2.13.0+cpu")
    with _Index(root) as index:
        yield index


def test_cpu_machine_falls_back_to_pypi_when_the_cpu_index_is_unreachable(pypi_folder: Path) -> None:
    port = _closed_port()
    proc = _run("cpu", f"http://127.0.0.1:{port}/whl/cpu", {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(pypi_folder)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"PyTorch's CPU wheel index cannot be reached: http://127.0.0.1:{port}/whl/cpu/torch/" in out
    assert "falling back to pip's configured index" in out
    pip_lines = [line for line in out.splitlines() if line.startswith("$ ")]
    assert len(pip_lines) == 1 and "--index-url" not in pip_lines[0] and "--dry-run" in pip_lines[0]
    # and it says which build the fallback gets: here, like PyPI on Linux x86_64, the CUDA build
    assert "pip would install torch 2.13.0: CUDA build (+1 nvidia-*/cuda-* wheels)" in out


def test_cpu_machine_uses_the_cpu_index_when_it_answers(cpu_index: _Index) -> None:
    proc = _run("auto", cpu_index.url, {})
    out = proc.stdout + proc.stderr
    if "GPU found" in out:
        pytest.skip("this machine has a GPU: auto picks the CUDA build")
    assert proc.returncode == 0, out
    assert "the CPU build (no GPU:" in out and "cannot be reached" not in out
    assert f"--index-url {cpu_index.url}" in out
    assert "pip would install torch 2.13.0+cpu: CPU build (no nvidia-* wheels)" in out
    assert "/torch/" in cpu_index.paths


def test_gpu_machine_goes_to_pypi_and_never_asks_the_cpu_index(cpu_index: _Index, pypi_folder: Path) -> None:
    proc = _run("cuda", cpu_index.url, {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(pypi_folder)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "the CUDA build (INFLIGHT_TORCH=cuda" in out and "--index-url" not in out
    assert "pip would install torch 2.13.0: CUDA build (+1 nvidia-*/cuda-* wheels)" in out
    assert cpu_index.paths == []


def test_a_bad_mode_is_refused_before_pip_runs() -> None:
    proc = _run("rocm", "http://127.0.0.1:9/", {})
    assert proc.returncode == 2 and "INFLIGHT_TORCH must be one of auto, cpu, cuda, not 'rocm'" in proc.stderr
    assert "$ " not in proc.stdout


def test_an_installed_cpu_torch_is_left_alone(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``make run`` does here the second time: this venv's torch is the wanted one."""
    got = it.installed_torch(sys.executable)
    assert got is not None and got.version.startswith(it.TORCH_VERSION)
    monkeypatch.setenv("INFLIGHT_TORCH", got.build)
    monkeypatch.setattr(it, "install", lambda *a, **k: pytest.fail("pip must not run"))
    assert it.main(["--python", sys.executable]) == 0
    assert f"already installed: torch {got.version}" in capsys.readouterr().out
