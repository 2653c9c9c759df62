"""Loading a local Hugging Face checkpoint directory into our decoder.

Reads ``config.json`` through transformers' ``AutoConfig`` and the weights from
``model.safetensors`` or a sharded ``model.safetensors.index.json``, fusing q/k/v and
gate/up projections as they load. Never downloads anything: the path must be a directory.

Under tensor parallelism each rank reads only its slice of each tensor (``get_slice``), as
its :class:`~inflight.runtime.model.layout.ShardLayout` says, so no rank ever holds
the whole model. Row-parallel biases (o_proj, down_proj) are added once, by rank 0. Expert
weights of mixture-of-experts models (either layout) go through :mod:`.moe_weights`;
packed linears (GGUF blocks, compressed-tensors words) are installed by the caller's
``install_packed`` (:mod:`.quantization`) and their float tensors skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inflight.runtime.model import compressed_tensors, deepseek_v3, kv_scales, llama4, moe_weights, mxfp4, stages
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.decoder import CausalLM
from inflight.runtime.model.granite_hybrid import GraniteHybridLM, checkpoint_name
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.qwen2_5_vl_vision import VisionTower, load_vision_tensor
from inflight.runtime.model.qwen3_next import Qwen3NextLM
from inflight.runtime.model.spec import ModelSpec, model_type_alias, spec_from_hf_config
from inflight.runtime.model.stages import StageLayers

logger = logging.getLogger("inflight.model")
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


def checkpoint_tensors(model_dir: str | Path, progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
    """``(name, slice)`` for every checkpoint tensor of ``model_dir``; a slice reads only the
    part that is indexed (``part[:]``, ``part[a:b]``). A converted GGUF directory's quantized
    tensors come from its GGUF file, dequantized when read."""
    model_dir = Path(model_dir)
    yield from _iter_tensors(_weight_files(model_dir), progress)
    index = model_dir / "model.safetensors.index.json"
    in_gguf = json.loads(index.read_text()).get("gguf_tensors") if index.is_file() else None
    if in_gguf:
        from inflight.runtime.model.gguf_convert import gguf_float_tensors
        from inflight.runtime.model.gguf_link import SOURCE_LINK

        source = model_dir / SOURCE_LINK
        if not source.is_file():
            raise ValueError(f"{model_dir} keeps {len(in_gguf)} quantized tensors in its GGUF file, but "
                             f"{source} is missing or broken; convert the .gguf file again.")
        if progress:
            progress(f"loading weights: {len(in_gguf)} quantized tensors kept in {source.resolve().name}")
        yield from gguf_float_tensors(source, in_gguf)


def _iter_tensors(files: list[Path], progress: Progress | None) -> Iterator[tuple[str, Any]]:
    """``(name, slice)`` for every tensor of the safetensors ``files``."""
    for i, path in enumerate(files):
        if progress:
            progress(f"loading weights: shard {i + 1}/{len(files)} ({path.name}, {path.stat().st_size / 1e6:.0f} MB)")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


def _mlp_width(name: str, spec: ModelSpec) -> int:
    """The full intermediate width of the MLP tensor ``name`` belongs to: GLM-4.5's shared expert
    (``mlp.shared_experts.*``) has its own; every other dense MLP the config's."""
    if ".shared_experts." in name and spec.moe is not None:
        return spec.moe.shared_intermediate_size
    return spec.intermediate_size


def _slices(spec: ModelSpec, layout: ShardLayout, fused: str, name: str = "") -> list[tuple[int, int]]:
    """Rows of this rank's fused tensor that each checkpoint tensor fills."""
    if fused == "qkv_proj":
        q, kv = layout.num_heads * spec.head_dim, layout.num_kv_heads * spec.head_dim
        q *= 2 if spec.attn_output_gate else 1  # Qwen3-Next: a gate per head beside each query head
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    n = _mlp_width(name, spec) // layout.world_size
    return [(0, n), (n, 2 * n)]


def _read_prefused(name: str, part: Any, spec: ModelSpec, layout: ShardLayout) -> torch.Tensor | None:
    """This rank's rows of a checkpoint tensor that is fused already (Phi-3's ``qkv_proj`` and
    ``gate_up_proj`` weights: q, k, v rows / gate, up rows), each part sliced as its unfused
    tensor would be; None for any other tensor or when unsharded."""
    parts = name.split(".")
    if not layout.is_sharded or len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in ("qkv_proj", "gate_up_proj"):
        return None
    hd = spec.head_dim
    if parts[-2] == "qkv_proj":
        sizes = [spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd]
        modules = ["q_proj", "k_proj", "v_proj"]
    else:
        sizes, modules = [_mlp_width(name, spec)] * 2, ["gate_proj", "up_proj"]
    if part.get_shape()[0] != sum(sizes):
        return part[:]  # the wrong shape: load_model names the tensor and both shapes
    pieces, offset = [], 0
    for module, size in zip(modules, sizes, strict=True):
        split = _split(module, spec, layout, name)
        assert split is not None
        _, _, start, length = split
        pieces.append(part[offset + start : offset + start + length])
        offset += size
    return torch.cat(pieces)


def _split(module: str, spec: ModelSpec, layout: ShardLayout, name: str = "") -> tuple[int, int, int, int] | None:
    """``(axis, full size, start, length)`` of this rank's part of ``module``'s weight, or None."""
    hd, lay = spec.head_dim, layout
    if module in ("gate_proj", "up_proj", "down_proj"):
        full = _mlp_width(name, spec)
        width = full // lay.world_size
        return (0 if module != "down_proj" else 1), full, lay.rank * width, width
    if module == "q_proj":
        return 0, spec.num_heads * hd, lay.q_head_start * hd, lay.num_heads * hd
    if module in ("k_proj", "v_proj"):
        return 0, spec.num_kv_heads * hd, lay.kv_head_start * hd, lay.num_kv_heads * hd
    if module == "o_proj":
        return 1, spec.num_heads * hd, lay.q_head_start * hd, lay.num_heads * hd
    if module in ("embed_tokens", "lm_head"):
        return 0, spec.vocab_size, lay.vocab_start, lay.vocab_end - lay.vocab_start
    return None


def _read_shard(name: str, part: Any, spec: ModelSpec, layout: ShardLayout) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``name`` (the whole tensor when unsplit)."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    split = _split(module, spec, layout, name)
    fused = _read_prefused(name, part, spec, layout)
    if fused is not None:
        return fused
    if layout.is_sharded and kind == "sinks":  # gpt-oss: a logit per query head, split with the heads
        return part[layout.q_head_start : layout.q_head_start + layout.num_heads]
    if not layout.is_sharded or split is None:
        return part[:]
    axis, full, start, length = split
    shape = part.get_shape()
    if module in ("o_proj", "down_proj") and kind == "bias":  # added once, after the all-reduce
        full_bias = part[:]
        return full_bias if layout.rank == 0 else torch.zeros_like(full_bias)
    if len(shape) <= axis or shape[axis] != full:
        return part[:]  # the wrong shape: load_model names the tensor and both shapes
    rows = part[start : start + length] if axis == 0 else part[:, start : start + length]
    pad = layout.vocab_per_rank - length if module in ("embed_tokens", "lm_head") else 0
    return rows if pad == 0 else torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: Progress | None = None,
    config: Any | None = None,
    tp: Collectives | None = None,
    install_packed: Callable[[CausalLM], frozenset[str]] | None = None,
    stage: StageLayers | None = None,
) -> tuple[CausalLM, Any]:
    """Our decoder (this rank's shard under ``tp``) on ``device`` in ``dtype``; and the HF config.
    ``install_packed`` puts packed weights into the model while it is on the meta device and
    returns the checkpoint tensors to skip (default: a compressed-tensors checkpoint's own)."""
    model_dir = Path(model_dir)
    config = config if config is not None else load_hf_config(model_dir)
    spec = spec_from_hf_config(config)
    alias = model_type_alias(config)
    if alias is not None:
        logger.warning("%s", alias)
    with torch.device("meta"):
        own = {"qwen3_next": Qwen3NextLM, "granitemoehybrid": GraniteHybridLM}  # hybrid models: their own class
        model = own.get(spec.arch, CausalLM)(spec, tp, stage)
        if spec.arch == "qwen2_5_vl":  # the vision tower rides beside the decoder (model/qwen2_5_vl_vision.py)
            model.visual = VisionTower(config.vision_config)
    # packed linears (GGUF blocks, compressed-tensors int4/int8) go in while the model is on
    # meta, so they never exist in float; their checkpoint tensors are skipped below
    if install_packed is None:
        packed = compressed_tensors.install_packed_linears(model, model_dir, config, device)
    else:
        packed = install_packed(model)
    if packed and spec.arch in ("llama4_text", "phi3"):  # packed rows cannot be permuted / cut per part here
        raise ValueError(f"packed (GGUF / compressed-tensors) {spec.arch} checkpoints are not served: Llama 4's q/k "
                         "rows are permuted at load and Phi-3's fused qkv/gate_up rows cut per part, which packed "
                         "weights do not allow; serve a float checkpoint.")  # fmt: skip
    if packed and spec.mla is not None:  # W_UK / W_UV are sliced out of a float kv_b_proj (model/mla.py)
        raise ValueError("packed (GGUF / compressed-tensors) DeepSeek-V3 checkpoints are not served: latent "
                         "attention's absorbed decode needs a float kv_b_proj; serve a bf16 checkpoint.")
    refuse_buffers(model)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    num_mtp = 0  # DeepSeek-V3's multi-token-prediction tensors skipped (model/deepseek_v3.py)
    tensors = checkpoint_tensors(model_dir, progress)
    if mxfp4.is_mxfp4(config):  # gpt-oss's MXFP4 experts, dequantized as they stream past
        tensors = mxfp4.dequantized_tensors(tensors, dtype)
    for hf_name, part in tensors:
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name
        name = name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's router is our mlp.gate
        if spec.arch == "llama4_text":  # feed_forward.{router,shared_expert,experts}: our mlp.{gate,shared_experts,experts}
            name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
            name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        if spec.arch == "granitemoehybrid":  # Granite 4's names (model/granite_hybrid.py)
            name = checkpoint_name(name, spec)
        if spec.arch == "qwen3_next":  # mlp.shared_expert is our mlp.shared_experts; mtp.*: its MTP head, skipped
            name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
            if name.startswith("mtp."):
                continue
        if "rotary_emb" in name or hf_name in packed or _is_mtp_layer(name, spec):
            continue
        if spec.arch == "qwen2_5_vl" and name.startswith("visual."):
            load_vision_tensor(model.visual, name.removeprefix("visual."), part)
            loaded.add(name)
            continue
        if spec.mla is not None and deepseek_v3.is_mtp_layer(name, spec):
            num_mtp += 1
            continue
        if model.stage is not None:  # a pipeline stage: its own layers, renumbered (model/stages.py)
            name = stages.local_name(name, model.stage, spec.tie_word_embeddings)
            if name is None:
                continue
        scale = kv_scales.checkpoint_scale(name)  # an fp8 KV cache's scales: kept on the layer
        if scale is not None:
            kv_scales.record(model, scale[0], scale[1], part)
            continue
        piece = moe_weights.expert_piece(name) if spec.moe is not None else None
        if piece is not None:
            loaded.add(_load_expert_piece(hf_name, piece, part, params, model, dtype))
            continue
        parts = name.split(".")
        target = name
        rows: tuple[int, int] | None = None
        mla_attention = spec.mla is not None and ".self_attn." in name  # DeepSeek-V3's q_proj is its own
        if len(parts) >= 2 and parts[-2] in _FUSED and not mla_attention:
            fused, idx = _FUSED[parts[-2]]
            parts[-2] = fused
            target = ".".join(parts)
            rows = _slices(spec, model.layout, fused, name)[idx]
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not fit the {spec.arch} decoder.")
        if mla_attention:  # latent attention's own head arithmetic (model/deepseek_v3.py)
            tensor = deepseek_v3.read_attention_tensor(name, part, spec, model.layout)
        else:
            tensor = _read_shard(name, part, spec, model.layout)
        if spec.arch == "llama4_text" and name.split(".")[-2] in ("q_proj", "k_proj"):
            tensor = llama4.halves_from_pairs(tensor, spec.head_dim)  # interleaved rotary pairs -> our halves
        with torch.no_grad():
            dest = params[target] if rows is None else params[target][rows[0] : rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
            dest.copy_(tensor.to(dtype))
        loaded.add(f"{target}:{rows}")
    _check_complete(model, spec, loaded)
    if spec.mla is not None:
        deepseek_v3.log_skipped_mtp(config, num_mtp)
    if spec.norm_plus_one:  # Gemma's RMSNorm scales by (1 + weight): fold the 1 in once, here
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") and ".linear_attn." not in name:  # Qwen3-Next's gated norm: as is
                    param.add_(1.0)
    model.eval()
    return model, config


def _is_mtp_layer(name: str, spec: ModelSpec) -> bool:
    """GLM-4.5's multi-token-prediction layers (``layers.{num_layers + i}``): not the served model's,
    skipped as vLLM does (speculative method mtp loads them: spec_decode/mtp_head.py)."""
    parts = name.split(".")
    return (spec.arch == "glm4_moe" and len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit()
            and int(parts[1]) >= spec.num_layers)


def _load_expert_piece(
    hf_name: str, piece: moe_weights.ExpertPiece, part: Any, params: dict[str, torch.nn.Parameter],
    model: CausalLM, dtype: torch.dtype,
) -> str:
    """Copy this rank's part of an expert tensor into our fused expert parameter; its key."""
    if piece.target not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} does not fit the {model.spec.arch} decoder.")
    tensor = moe_weights.read_piece(hf_name, piece, part, model.spec, model.layout)
    with torch.no_grad():
        dest = moe_weights.destination(params[piece.target], piece)
        if dest.shape != tensor.shape:
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
        dest.copy_(tensor.to(dtype))
    return piece.key


def refuse_buffers(model: torch.nn.Module) -> None:
    """The model is built on the meta device and then allocated empty, and a buffer is in no
    checkpoint this loader reads: it would serve whatever the memory held (Qwen2.5-VL's vision
    rotary frequencies once did, NaN now and then). Modules compute such tensors instead."""
    names = [name for name, _ in model.named_buffers()]
    if names:
        raise RuntimeError(f"model buffers would be left uninitialized by the empty allocation: {', '.join(names[:5])}"
                           "; compute them in the module instead of registering them")  # fmt: skip


def _check_complete(model: CausalLM, spec: ModelSpec, loaded: set[str]) -> None:
    loaded_names = {key.split(":")[0] for key in loaded}
    missing = [
        n for n, _ in model.named_parameters()
        if n not in loaded_names and not (spec.tie_word_embeddings and n == "lm_head.weight")
    ]
    if spec.tie_word_embeddings and "lm_head.weight" in loaded_names:
        missing = [n for n in missing if n != "embed_tokens.weight"]
    missing += moe_weights.missing_pieces(spec, loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
