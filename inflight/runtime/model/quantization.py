"""Which form the engine holds its weights in: ``EngineConfig.quantization`` resolved against
the checkpoint, and the packed weights put in place.

``auto`` (the default) serves a checkpoint as it is stored: a GGUF file (the converted
directory links back to it as ``source.gguf``) keeps its block-quantized tensors packed when
the model and machine have packed kernels for them (one rank, dense MLP, a native or Triton
linear kernel for the device; otherwise the weights are dequantized and the start-up log says
why); a compressed-tensors ``pack-quantized`` directory keeps its int4/int8 weights; anything
else is served in the float ``dtype``. ``none`` dequantizes everything (as before packed
weights existed); ``gguf`` and ``compressed-tensors`` insist, and fail with the reason when
they cannot apply. A checkpoint quantized some other way is refused naming what is supported.

Knows the checkpoint formats only through :mod:`~inflight.runtime.model.quantized` (GGUF) and
:mod:`~inflight.runtime.model.compressed_tensors`; knows nothing about scheduling or serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.model.gguf_source import SOURCE_LINK as GGUF_SOURCE_LINK

DEQUANTIZED_AT_LOAD = ("mxfp4",)  # quant_method values the loader turns into float weights


@dataclass(frozen=True, slots=True)
class QuantizationChoice:
    """What ``quantization`` became for this checkpoint and why (one line for the log)."""

    method: str  # "none" | "gguf" | "compressed-tensors"
    why: str


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, when it links back to one."""
    link = model_dir / GGUF_SOURCE_LINK
    return link.resolve() if link.is_file() else None


def _checkpoint_method(hf_config: Any) -> str | None:
    """The checkpoint's ``quant_method`` when inflight serves it, ``None`` for a float one;
    any other quantization raises ``ValueError`` naming what is supported."""
    from inflight.runtime.model import compressed_tensors

    qc = getattr(hf_config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)) in DEQUANTIZED_AT_LOAD:
        return str(getattr(method, "value", method))
    if compressed_tensors.detect(hf_config) is None:  # raises for anything it cannot serve
        return None
    return "compressed-tensors"


def _gguf_blocker(runner: Any) -> str | None:
    """Why the packed GGUF weights cannot be served on this runner, or ``None``."""
    from inflight.kernels.dispatch import packed_linear_backend
    from inflight.kernels.quant_reference import QuantizedWeight

    if runner.tp is not None:
        return "tensor parallelism splits float weights only"
    if runner.spec.moe is not None:
        return "mixture-of-experts layers take float experts only"
    probe = QuantizedWeight("Q8_0", torch.zeros((1, 34), dtype=torch.uint8, device=runner.device), 32)
    if runner.device.type == "cpu" and runner.dtype != torch.float32:
        return f"the native packed kernels take float32 activations (dtype is {runner.dtype})"
    if packed_linear_backend(runner.ops.name, probe, runner.device) == "torch":
        return f"no packed linear kernel for {runner.ops.name} on {runner.device.type}"
    return None


def resolve_quantization(requested: str, runner: Any) -> QuantizationChoice:
    """``requested`` (an ``EngineConfig.quantization`` value) for ``runner``'s checkpoint."""
    model_dir = Path(runner.model_dir)
    stored = _checkpoint_method(runner.hf_config)
    source = gguf_source(model_dir)
    if stored == "compressed-tensors":
        if requested in ("auto", "compressed-tensors"):
            return QuantizationChoice("compressed-tensors", "the checkpoint's pack-quantized weights")
        raise ValueError(f"quantization={requested} does not fit a compressed-tensors checkpoint; "
                         "use auto or compressed-tensors.")
    if requested == "compressed-tensors":
        raise ValueError(f"quantization=compressed-tensors needs a checkpoint whose config.json has a "
                         f"compressed-tensors quantization_config; {model_dir} has none.")
    if requested == "none" or (requested == "auto" and source is None):
        why = f"{stored} weights dequantized at load" if stored else "float checkpoint"
        return QuantizationChoice("none", why if source is None else "GGUF tensors dequantized (quantization=none)")
    if source is None:
        raise ValueError(f"quantization=gguf needs a .gguf file as --model (got the directory {model_dir}).")
    blocker = _gguf_blocker(runner)
    if blocker is None:
        return QuantizationChoice("gguf", f"{source.name}'s block-quantized tensors kept packed")
    if requested == "gguf":
        raise ValueError(f"quantization=gguf cannot apply here: {blocker}; use quantization=none.")
    return QuantizationChoice("none", f"GGUF tensors dequantized: {blocker}")


def serve_quantized(runner: Any, requested: str, progress: Callable[[str], None] | None = None) -> QuantizationChoice:
    """Resolve ``requested`` and put packed weights in ``runner.model`` (wrapping ``runner.ops``
    so its ``linear`` takes them); returns what was chosen."""
    from inflight.kernels.dispatch import with_quantized_linear

    choice = resolve_quantization(requested, runner)
    detail = ""
    if choice.method == "gguf":
        from inflight.runtime.model.quantized import quantize_runner

        source = gguf_source(Path(runner.model_dir))
        assert source is not None  # resolve_quantization checked
        summary = quantize_runner(runner, source)
        detail = (f": {summary.num_quantized} linears, {summary.quantized_bytes / 2**20:.0f} MiB packed "
                  f"({summary.float32_bytes / 2**20:.0f} MiB as float32)")
        _release_float_memory(runner)
    elif choice.method == "compressed-tensors":
        from inflight.runtime.model.compressed_tensors import load_compressed_tensors_into

        summary = load_compressed_tensors_into(runner.model, Path(runner.model_dir), runner.device)
        runner.ops = with_quantized_linear(runner.ops)
        detail = f": {summary.num_quantized} linears, {summary.quantized_bytes / 2**20:.0f} MiB packed"
    if progress:
        progress(f"weights: quantization={choice.method} ({choice.why}){detail}")
    return choice


def _release_float_memory(runner: Any) -> None:
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # the dropped float weights, before the KV cache is sized
