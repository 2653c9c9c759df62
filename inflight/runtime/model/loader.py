"""Loading a local Hugging Face checkpoint directory into our decoder.

Reads ``config.json`` through transformers' ``AutoConfig`` and the weights from
``model.safetensors`` or a sharded ``model.safetensors.index.json``, fusing q/k/v and
gate/up projections as they load. Never downloads anything: the path must be a directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inflight.runtime.model.decoder import CausalLM
from inflight.runtime.model.spec import ModelSpec, spec_from_hf_config

Progress = Callable[[str], None]

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model directory: it has no config.json.")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} holds no safetensors weights (model.safetensors or an index).")


def _iter_tensors(files: list[Path], progress: Progress | None) -> Iterator[tuple[str, torch.Tensor]]:
    for i, path in enumerate(files):
        if progress:
            progress(f"loading weights: shard {i + 1}/{len(files)} ({path.name})")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _slices(spec: ModelSpec, fused: str) -> list[tuple[int, int]]:
    if fused == "qkv_proj":
        q, kv = spec.q_size, spec.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    n = spec.intermediate_size
    return [(0, n), (n, 2 * n)]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: Progress | None = None,
    config: Any | None = None,
) -> tuple[CausalLM, Any]:
    """Our decoder with the checkpoint's weights, on ``device`` in ``dtype``; and the HF config."""
    model_dir = Path(model_dir)
    config = config if config is not None else load_hf_config(model_dir)
    spec = spec_from_hf_config(config)
    with torch.device("meta"):
        model = CausalLM(spec)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor in _iter_tensors(_weight_files(model_dir), progress):
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        target = name
        rows: tuple[int, int] | None = None
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, idx = _FUSED[parts[-2]]
            parts[-2] = fused
            target = ".".join(parts)
            rows = _slices(spec, fused)[idx]
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not fit the {spec.arch} decoder.")
        with torch.no_grad():
            dest = params[target] if rows is None else params[target][rows[0] : rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
            dest.copy_(tensor.to(dtype))
        loaded.add(f"{target}:{rows}")
    _check_complete(model, spec, loaded)
    model.eval()
    return model, config


def _check_complete(model: CausalLM, spec: ModelSpec, loaded: set[str]) -> None:
    loaded_names = {key.split(":")[0] for key in loaded}
    missing = [
        n for n, _ in model.named_parameters()
        if n not in loaded_names and not (spec.tie_word_embeddings and n == "lm_head.weight")
    ]
    if spec.tie_word_embeddings and "lm_head.weight" in loaded_names:
        missing = [n for n in missing if n != "embed_tokens.weight"]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
