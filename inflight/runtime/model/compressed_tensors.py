"""Serving compressed-tensors ``pack-quantized`` checkpoints: int4/int8 weight-only linears.

llmcompressor writes these for GPTQ/AWQ-style W4A16/W8A16 models (vLLM serves them): each
quantized ``nn.Linear`` is stored as ``<module>.weight_packed`` (int32), ``.weight_scale``,
``.weight_shape`` and, when asymmetric, ``.weight_zero_point`` (packed along out_features)
instead of ``.weight``; ``config.json``'s ``quantization_config`` says how.

:func:`detect` reads that config into a :class:`CompressedTensorsScheme`, refusing anything
else quantized with a message naming what is supported. :func:`install_packed_linears` puts
:class:`~inflight.kernels.intq_reference.IntQuantWeight` s into a :class:`CausalLM` in place of
the float weights: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj`` (rows concatenated:
groups run along in_features, so rows are independent), ``o_proj``, ``down_proj``, and the LM
head when it is quantized. The loader calls it on the model while it is still on the meta
device (:func:`inflight.runtime.model.quantization.load_weights` asks it to), so the quantized
linears never exist in float (peak memory: the packed weights). Single rank, dense linears (not MoE experts). Knows nothing about serving or
the kernels that run the packed weights (``with_quantized_linear`` picks them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from inflight.kernels.intq_reference import IntQuantWeight, unpack_zero_point

SUPPORTED = ("compressed-tensors checkpoints in the pack-quantized format with int weights of 4 or 8 "
             "bits, group or channel strategy, symmetric or not, and no activation quantization "
             "(llmcompressor's W4A16/W8A16)")
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
_FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
          "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}


@dataclass(frozen=True, slots=True)
class WeightArgs:
    """One config group's weight quantization."""

    num_bits: int  # 4 or 8
    group_size: int | None  # None: channel-wise (one scale per output feature)
    symmetric: bool
    targets: tuple[str, ...]  # "Linear", exact module names, or "re:<regex>"


@dataclass(frozen=True, slots=True)
class CompressedTensorsScheme:
    """A checkpoint's supported ``quantization_config``."""

    groups: tuple[WeightArgs, ...]
    ignore: tuple[str, ...]

    def args_for(self, module: str) -> WeightArgs | None:
        """The group quantizing checkpoint module ``module`` (most specific target first)."""
        if any(_matches(module, t) for t in self.ignore):
            return None
        for rank in (0, 1, 2):
            for group in self.groups:
                if any(_target_rank(module, t) == rank for t in group.targets):
                    return group
        return None


def _target_rank(module: str, target: str) -> int | None:
    """0: the exact name; 1: a regex match; 2: the class (every quantizable module is a Linear)."""
    if target == module:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) else None
    return 2 if target == "Linear" else None


def _matches(module: str, target: str) -> bool:
    return _target_rank(module, target) is not None


def _as_dict(hf_config: Any) -> dict[str, Any] | None:
    """``quantization_config`` of a transformers config or a config.json dict, as a dict."""
    if isinstance(hf_config, Mapping):
        qc = hf_config.get("quantization_config")
    else:
        qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, Mapping):
        return None if qc is None else dict(qc)
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def detect(hf_config: Any) -> CompressedTensorsScheme | None:
    """The checkpoint's scheme; ``None`` for a float checkpoint. ``hf_config`` is a
    transformers config or config.json as a dict. Any other quantization: ``ValueError``."""
    qc = _as_dict(hf_config)
    if qc is None:
        return None
    method = str(qc.get("quant_method"))
    if method != "compressed-tensors":
        raise ValueError(f"the checkpoint is quantized with quant_method={method!r}, which inflight cannot serve; "
                         f"supported: GGUF files (docs/quantization.md), {SUPPORTED}, and float checkpoints.")
    return _parse(qc)


def scheme_of(hf_config: Any) -> CompressedTensorsScheme | None:
    """:func:`detect` for compressed-tensors checkpoints; ``None`` for every other one
    (float, or another ``quant_method`` that someone else handles or refuses)."""
    qc = _as_dict(hf_config)
    return None if qc is None or qc.get("quant_method") != "compressed-tensors" else _parse(qc)


def _refuse(what: str) -> ValueError:
    return ValueError(f"this compressed-tensors checkpoint has {what}; supported: {SUPPORTED}.")


def check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """A ``kv_cache_scheme`` is fine when it is 8-bit float K/V with per-tensor (or per-head) scales:
    the checkpoint's ``self_attn.k_scale``/``v_scale`` tensors are what an fp8 KV cache
    (--kv-cache-dtype fp8) reads (inflight.runtime.model.kv_scales); anything else is refused."""
    if not scheme:
        return
    if scheme.get("num_bits") != 8 or scheme.get("type", "float") != "float" or \
            scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise _refuse(f"a kv_cache_scheme other than 8-bit float per tensor ({json.dumps(scheme)[:80]})")


def _parse(qc: dict[str, Any]) -> CompressedTensorsScheme:
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(f"a {key} ({json.dumps(qc[key])[:80]})")
    check_kv_cache_scheme(qc.get("kv_cache_scheme"))
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("no config_groups")
    parsed = tuple(_parse_group(name, g, qc.get("format")) for name, g in groups.items())
    return CompressedTensorsScheme(parsed, tuple(qc.get("ignore") or ()))


def _parse_group(name: str, group: dict[str, Any], default_format: str | None) -> WeightArgs:
    fmt = group.get("format") or default_format
    if fmt != "pack-quantized":
        raise _refuse(f"config group {name!r} in the {fmt!r} format")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise _refuse(f"{key} quantization in config group {name!r}")
    w = group.get("weights") or {}
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise _refuse(f"{w.get('type')} weights of {w.get('num_bits')} bits in config group {name!r}")
    if w.get("dynamic") or w.get("block_structure") or w.get("actorder") in ("group", "dynamic"):
        raise _refuse(f"dynamic, block or group-actorder weights in config group {name!r}")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel") or (strategy == "group" and not w.get("group_size")):
        raise _refuse(f"the {strategy!r} weight strategy in config group {name!r}")
    group_size = int(w["group_size"]) if strategy == "group" else None
    return WeightArgs(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                      tuple(group.get("targets") or ("Linear",)))


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir} holds no safetensors weights (model.safetensors or an index).")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class CheckpointReader:
    """Reads whole tensors by name; each safetensors file is opened once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor | None:
        path = self.files.get(name)
        if path is None:
            return None
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)


def read_packed_weight(reader: CheckpointReader, module: str, args: WeightArgs, device: torch.device) -> IntQuantWeight:
    """Checkpoint module ``module``'s packed tensors as one :class:`IntQuantWeight` on ``device``."""
    packed, scale = reader.get(f"{module}.weight_packed"), reader.get(f"{module}.weight_scale")
    shape, zero_point = reader.get(f"{module}.weight_shape"), reader.get(f"{module}.weight_zero_point")
    if packed is None or scale is None or shape is None:
        raise ValueError(f"{module}: a pack-quantized module needs weight_packed, weight_scale and weight_shape.")
    out_features, in_features = (int(v) for v in shape.tolist())
    if packed.shape[0] != out_features:
        raise ValueError(f"{module}: weight_packed has {packed.shape[0]} rows, weight_shape says {out_features}.")
    if args.symmetric != (zero_point is None):
        raise ValueError(f"{module}: the config says symmetric={args.symmetric} but the checkpoint "
                         f"{'has' if zero_point is not None else 'has no'} weight_zero_point.")
    if zero_point is not None and zero_point.dtype == torch.int32 and zero_point.shape[0] != out_features:
        zero_point = unpack_zero_point(zero_point, args.num_bits, out_features)
    elif zero_point is not None:  # stored unpacked by older writers
        zero_point = zero_point.to(torch.int8)
    group_size = args.group_size if args.group_size is not None else in_features
    try:
        weight = IntQuantWeight(packed.contiguous(), scale.contiguous(), in_features, args.num_bits, group_size,
                                zero_point)
    except ValueError as exc:
        raise ValueError(f"{module}: {exc}") from None
    return _to(weight, device)


def _to(w: IntQuantWeight, device: torch.device) -> IntQuantWeight:
    zp = None if w.weight_zero_point is None else w.weight_zero_point.to(device)
    return IntQuantWeight(w.weight_packed.to(device), w.weight_scale.to(device), w.in_features, w.num_bits,
                          w.group_size, zp)


def _concat(parts: list[IntQuantWeight], what: str) -> IntQuantWeight:
    first = parts[0]
    kinds = {(p.num_bits, p.group_size, p.in_features, p.weight_scale.dtype, p.symmetric) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"{what}: the parts fused into one matmul are quantized differently ({kinds}); "
                         "inflight fuses q/k/v and gate/up, so each set must share one scheme.")
    if len(parts) == 1:
        return first
    zp = None if first.symmetric else torch.cat([p.weight_zero_point for p in parts])  # type: ignore[misc]
    return IntQuantWeight(torch.cat([p.weight_packed for p in parts]), torch.cat([p.weight_scale for p in parts]),
                          first.in_features, first.num_bits, first.group_size, zp)


def _target_of(module: str) -> tuple[str, tuple[str, ...]]:
    """Our linear for checkpoint module ``module``, and the checkpoint modules fused into it."""
    name = module.removeprefix("model.")
    prefix, _, leaf = name.rpartition(".")
    if leaf in _FUSED:
        fused, members = _FUSED[leaf]
        pre = module.rpartition(".")[0]
        return f"{prefix}.{fused}", tuple(f"{pre}.{m}" for m in members)
    return name, (module,)


def _packed_modules(files: dict[str, Path]) -> list[str]:
    return sorted(n.removesuffix(".weight_packed") for n in files if n.endswith(".weight_packed"))


def _check_model(model: Any, modules: list[str]) -> None:
    if model.tp is not None:
        raise ValueError("compressed-tensors packed weights are served on one rank: tensor parallelism splits "
                         "float weights only (use tensor_parallel_size=1).")
    experts = [m for m in modules if ".experts." in m]
    if experts:
        raise ValueError(f"packed mixture-of-experts weights ({experts[0]}, ...) are not supported; "
                         "quantize the attention and dense layers only (ignore the experts).")
    if model.spec.tie_word_embeddings and "lm_head" in modules:
        raise ValueError("a packed lm_head tied to the token embedding is not supported.")


def _linear(model: nn.Module, target: str, module: str) -> nn.Linear:
    try:
        linear = model.get_submodule(target)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"packed checkpoint module {module!r} has no linear {target!r} in the "
                         f"{model.spec.arch} decoder to go to.")
    return linear


def _fill(model: Any, reader: CheckpointReader, scheme: CompressedTensorsScheme, modules: list[str],
          device: torch.device) -> dict[str, IntQuantWeight]:
    """Put each packed linear's weight in place (read unless already there); ours -> weight."""
    done: dict[str, IntQuantWeight] = {}
    packed = set(modules)
    for module in modules:
        target, members = _target_of(module)
        if target in done:
            continue
        linear = _linear(model, target, module)
        held = linear.__dict__.get("weight")
        if not isinstance(held, IntQuantWeight):
            parts = []
            for member in members:
                args = scheme.args_for(member)
                if args is None or member not in packed:
                    raise ValueError(f"{member}: fused into {target} with packed {module} but not packed "
                                     "(or ignored) itself; its parts must be quantized alike.")
                parts.append(read_packed_weight(reader, member, args, device))
            held = _concat(parts, target)
            if tuple(held.shape) != (linear.out_features, linear.in_features):
                raise ValueError(f"{target}: packed shape {held.shape}, expected "
                                 f"{(linear.out_features, linear.in_features)}.")
            del linear.weight  # the Parameter goes; a plain attribute the decoder passes to ops.linear
            linear.weight = held  # type: ignore[assignment]
        done[target] = held
    return done


def install_packed_linears(model: Any, model_dir: str | Path, hf_config: Any,
                           device: torch.device) -> frozenset[str]:
    """Put the checkpoint's packed weights into ``model`` (a :class:`CausalLM`, on the meta
    device or materialised); returns the checkpoint tensor names used (the loader skips them).
    Empty for a checkpoint that is not compressed-tensors."""
    scheme = scheme_of(hf_config)
    if scheme is None:
        return frozenset()
    files = _tensor_files(Path(model_dir))
    modules = _packed_modules(files)
    _check_model(model, modules)
    _fill(model, CheckpointReader(files), scheme, modules, device)
    packed = set(modules)
    return frozenset(n for n in files if n.rpartition(".")[0] in packed and n.rpartition(".")[2] in PACKED_SUFFIXES)
