"""A full float32 copy of a checkpoint, for reference tools that need every tensor in safetensors.

A converted GGUF directory leaves its quantized tensors in the GGUF file (see
:mod:`inflight.runtime.model.gguf_convert`); transformers and lm-eval's ``hf`` backend cannot
read them there. :func:`float_checkpoint_dir` writes, once, a sibling directory holding every
tensor as float32. Used by benchmarks and tests only; serving never needs it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from inflight.runtime.model.loader import Progress, checkpoint_tensors


def float_checkpoint_dir(model_dir: str | Path, progress: Progress | None = None) -> Path:
    """``model_dir`` itself, or, for a converted GGUF directory that left its quantized tensors in
    the file, a sibling ``<name>.float32`` directory holding every tensor as float32 safetensors
    (made once): what transformers and lm-eval's ``hf`` backend need as a reference."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file() or not json.loads(index.read_text()).get("gguf_tensors"):
        return model_dir
    out = model_dir.with_name(model_dir.name + ".float32")
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != index.name and f.suffix != ".gguf":
                shutil.copy(f, tmp / f.name)
        tensors = {name: part[:].contiguous() for name, part in checkpoint_tensors(model_dir, progress)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
