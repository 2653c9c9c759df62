"""Reading and checking one PEFT LoRA adapter directory against the served model.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``). :func:`read_adapter` returns its A and B matrices per (layer, module), in
float32 on the CPU, with the scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under
``use_rslora``) folded into B, or raises :class:`LoRAError` naming what it refuses: a missing
or pickled (``.bin``) weights file, anything targeted besides the seven decoder projections
(``embed_tokens``, ``lm_head``, experts, ``modules_to_save``), DoRA and the other PEFT variants,
a rank over ``max_lora_rank``, a layer or shape the base model does not have. Knows nothing
about devices, slots or requests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.lora.types import LoRAError, LoRAInfo
from inflight.runtime.model import llama4
from inflight.runtime.model.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES  # PEFT's names, in the decoder's order
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json keys whose PEFT feature changes the arithmetic: refused unless unset/empty.
_REFUSED_KEYS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication",
    "lora_bias": "lora_bias (a bias on LoRA B)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
}


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter read from disk: float32 CPU tensors, the scaling folded into each B."""

    info: LoRAInfo
    digest: str  # SHA-256 of the config and weights files: what the prefix-cache key covers
    # (layer, module) -> (A [rank, in_features], B [out_features, rank] * scaling)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(in_features, out_features) of ``module`` in the whole (unsharded) model."""
    q, kv, h, m = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}[module]  # fmt: skip


def read_adapter(name: str, path: str | Path, spec: ModelSpec, max_rank: int) -> AdapterWeights:
    """Read and check the adapter at ``path`` for a model of ``spec``; ``LoRAError`` says why not."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory (want {CONFIG_FILE} + {WEIGHTS_FILE}).")
    config = _read_config(name, folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / PICKLED_FILE).is_file():
            raise LoRAError(f"LoRA adapter {name!r}: only {PICKLED_FILE} (a pickle) found; pickles are not loaded. "
                            f"Save it with safe_serialization=True to get {WEIGHTS_FILE}.")
        raise LoRAError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r}.")
    rank, alpha, targets = _check_config(name, config, spec, max_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    data = _read_bytes(name, weights)
    tensors = _pair_tensors(name, _load_tensors(name, data), spec, rank, targets, scaling)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + b"\0" + data).hexdigest()
    base = config.get("base_model_name_or_path")
    info = LoRAInfo(name, str(path), rank, float(alpha), tuple(m for m in MODULES if m in targets),
                    base if isinstance(base, str) else None)  # fmt: skip
    return AdapterWeights(info, digest, tensors)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r}.")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not readable JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object.")
    return config


def _check_config(name: str, config: dict[str, Any], spec: ModelSpec, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, alpha, targeted module names) of a config this engine serves."""
    where = f"LoRA adapter {name!r}"
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not served; only LORA adapters are.")
    for key, what in _REFUSED_KEYS.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported; adapter_config.json sets {key}.")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {config['bias']!r} (trained biases) is not supported; want bias 'none'.")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer (got {rank!r}).")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is over max_lora_rank {max_rank}; raise --max-lora-rank.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{where}: lora_alpha must be a number (got {alpha!r}).")
    targets = _targets(where, config.get("target_modules"), spec)
    if spec.moe is not None and targets & set(MLP_MODULES):
        raise LoRAError(f"{where}: targets {', '.join(sorted(targets & set(MLP_MODULES)))} on a mixture-of-experts "
                        "model; adapters of its experts are not supported (attention modules are).")
    return rank, float(alpha), targets


def _targets(where: str, target: object, spec: ModelSpec) -> set[str]:
    """The decoder projections ``target_modules`` names (a list of PEFT suffixes, "all-linear",
    or a regex over module paths); any other module it names is a ``LoRAError``."""
    if target == "all-linear":
        return set(ATTENTION_MODULES) | (set() if spec.moe is not None else set(MLP_MODULES))
    if isinstance(target, str):
        try:
            pattern = re.compile(target)
        except re.error as exc:
            raise LoRAError(f"{where}: target_modules {target!r} is not a valid regex ({exc}).") from None
        found: set[str] = set()
        for path in _module_paths(spec):
            if pattern.fullmatch(path):
                module = path.rsplit(".", 1)[-1]
                if module not in MODULES or (spec.moe is not None and ".mlp." in path):
                    raise LoRAError(f"{where}: target_modules matches {path!r}; only {', '.join(MODULES)} "
                                    "of the decoder layers can be targeted.")
                found.add(module)
        if not found:
            raise LoRAError(f"{where}: target_modules {target!r} matches no module of the base model.")
        return found
    if not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise LoRAError(f"{where}: target_modules must be a list of module names or a regex (got {target!r}).")
    bad = [t for t in target if t.rsplit(".", 1)[-1] not in MODULES]
    if bad:
        raise LoRAError(f"{where}: cannot target {', '.join(map(repr, bad))}; only {', '.join(MODULES)} can be "
                        "targeted (not embed_tokens, lm_head or experts).")
    return {t.rsplit(".", 1)[-1] for t in target}


def _module_paths(spec: ModelSpec) -> list[str]:
    """The base model's module paths a PEFT regex is matched against (the ones it may name)."""
    paths = ["model.embed_tokens", "lm_head", "model.norm"]
    for i in range(spec.num_layers):
        paths += [f"model.layers.{i}.self_attn.{m}" for m in ATTENTION_MODULES]
        if spec.moe is not None:
            paths += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.experts"]
        paths += [f"model.layers.{i}.mlp.{m}" for m in MLP_MODULES]
    return paths


def _read_bytes(name: str, weights: Path) -> bytes:
    try:
        return weights.read_bytes()
    except OSError as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {WEIGHTS_FILE} ({exc.strerror or exc}).") from None


def _load_tensors(name: str, data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file ({exc}).") from None


def _pair_tensors(
    name: str, raw: dict[str, torch.Tensor], spec: ModelSpec, rank: int, targets: set[str], scaling: float
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    where = f"LoRA adapter {name!r}"
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A/B of {', '.join(MODULES)}; embeddings, "
                            "lm_head, experts and other modules cannot be adapted.")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or block != ("self_attn" if module in ATTENTION_MODULES else "mlp"):
            raise LoRAError(f"{where}: tensor {key!r} adapts {block}.{module}, which cannot be targeted.")
        if module not in targets:
            raise LoRAError(f"{where}: tensor {key!r} adapts {module}, which target_modules does not name.")
        if layer >= spec.num_layers:
            raise LoRAError(f"{where}: tensor {key!r} is for layer {layer}; the base model has {spec.num_layers} layers.")
        if not tensor.is_floating_point():
            raise LoRAError(f"{where}: tensor {key!r} is {tensor.dtype}, not a float tensor.")
        halves.setdefault((layer, module), {})[half] = tensor
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{where}: layer {layer} {module} has no {missing} tensor.")
        in_f, out_f = module_shape(spec, module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise LoRAError(f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                            f"model wants A ({rank}, {in_f}) and B ({out_f}, {rank}) (an adapter of another model?).")
        if spec.arch == "llama4_text" and module in ("q_proj", "k_proj"):  # the loader permutes these rows too
            b = llama4.halves_from_pairs(b, spec.head_dim)
        out[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    if not out:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors.")
    return out
