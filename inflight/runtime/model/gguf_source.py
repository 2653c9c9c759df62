"""What ``--model`` names: a Hugging Face directory, or a GGUF file converted once into a cache.

:func:`resolve_model_dir` is called before the loader: a directory passes through; a ``.gguf``
file is converted (first time only) into a directory keyed by the file's name, size and
modification time under the cache root (:func:`inflight.cache.cache_root`), which links back to
the file as ``source.gguf`` (the engine serves its packed tensors from there); anything else
gets a message that says what to do, since nothing is ever downloaded from a model hub.
Knows nothing about weights or tokenizers beyond asking :mod:`gguf_convert` to convert.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inflight.cache import building, cache_root
from inflight.runtime.model.gguf_link import link_source

Progress = Callable[[str], None]
_GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """True for a regular file that starts with the GGUF magic bytes."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def converted_dir_for(gguf_path: Path, root: Path | None = None) -> Path:
    """The cache directory a GGUF file converts into (changes when the file changes)."""
    st = gguf_path.stat()
    return (root or cache_root()) / "gguf" / f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"


def model_dir_problem(model: str) -> str | None:
    """Why ``model`` cannot be served (a message to print), or ``None`` when it can."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"{model} is a directory but not a model directory: it has no config.json."
        return None
    if path.is_file():
        if is_gguf_file(path):
            return None
        return f"{model} is a file but not a GGUF file; pass a model directory or a .gguf file."
    hint = ""
    if "/" in model and not model.startswith((".", "/")) and model.count("/") == 1:
        hint = (f" '{model}' looks like a Hugging Face hub id: inflight never downloads models; "
                f"fetch it first (e.g. `hf download {model} --local-dir models/{model.split('/')[1]}`)"
                " and pass that directory.")
    return f"{model}: no such directory or .gguf file.{hint}"


def resolve_model_dir(model: str | Path, progress: Progress | None = None) -> Path:
    """A local model directory for ``model``, converting a GGUF file the first time it is seen."""
    problem = model_dir_problem(str(model))
    if problem:
        raise ValueError(problem)
    path = Path(model)
    if path.is_dir():
        return path
    target = converted_dir_for(path.resolve())
    with building(target):  # another server converting the same file: wait, then use its result
        if (target / "config.json").is_file():
            if progress:
                progress(f"using the converted {path.name} in {target}")
        else:
            from inflight.runtime.model.gguf_convert import convert_gguf

            target = convert_gguf(path, target, progress)
        link_source(target, path.resolve())
    return target
