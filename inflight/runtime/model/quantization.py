"""Which form the engine holds its weights in: ``EngineConfig.quantization`` resolved against
the checkpoint, and the packed weights put in place.

``auto`` (the default) serves a checkpoint as it is stored: a GGUF file (the converted
directory links back to it as ``source.gguf``) keeps its block-quantized tensors packed when
the model and machine have packed kernels for them (one rank, dense MLP, a native or Triton
linear kernel for the device; otherwise the weights are dequantized and the start-up log says
why); a compressed-tensors ``pack-quantized`` directory keeps its int4/int8 weights; anything
else is served in the float ``dtype`` (in float32 on the native CPU kernels, with its linear
weights prepacked once for MKL's GEMM: :mod:`inflight.kernels.cpu_packed`). ``none``
dequantizes everything (as before packed weights existed); ``gguf`` and ``compressed-tensors``
insist, and fail with the reason when they cannot apply. A checkpoint quantized some other way is refused naming what is supported.

Knows the checkpoint formats only through :mod:`~inflight.runtime.model.quantized` (GGUF) and
:mod:`~inflight.runtime.model.compressed_tensors`; knows nothing about scheduling or serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.gguf_link import SOURCE_LINK as GGUF_SOURCE_LINK
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.model.stages import StageLayers

if TYPE_CHECKING:
    from inflight.kernels.dispatch import KernelOps

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


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where and how the weights are about to load (what the choice depends on)."""

    model_dir: Path
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    ops: KernelOps  # the float kernel bundle chosen for the device
    tensor_parallel: bool
    cpu_threads: int = 1  # threads a big step of this process uses on the CPU (the runner's policy)
    stage: StageLayers | None = None  # a pipeline stage's layers (model/stages.py); None: the whole model


def _gguf_blocker(target: LoadTarget) -> str | None:
    """Why the packed GGUF weights cannot be served here, or ``None``."""
    from inflight.kernels.dispatch import packed_linear_backend
    from inflight.kernels.quant_reference import QuantizedWeight

    if target.tensor_parallel:
        return "tensor parallelism splits float weights only"
    if spec_from_hf_config(target.hf_config).moe is not None:
        return "mixture-of-experts layers take float experts only"
    if target.device.type == "cpu" and target.dtype != torch.float32:
        return f"the native packed kernels take float32 activations (dtype is {target.dtype})"
    probe = QuantizedWeight("Q8_0", torch.zeros((1, 34), dtype=torch.uint8, device=target.device), 32)
    if packed_linear_backend(target.ops.name, probe, target.device) == "torch":
        return f"no packed linear kernel for {target.ops.name} on {target.device.type}"
    return None


def resolve_quantization(requested: str, target: LoadTarget) -> QuantizationChoice:
    """``requested`` (an ``EngineConfig.quantization`` value) for the checkpoint at ``target``."""
    model_dir = target.model_dir
    stored = _checkpoint_method(target.hf_config)
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
    blocker = _gguf_blocker(target)
    if blocker is None:
        return QuantizationChoice("gguf", f"{source.name}'s block-quantized tensors kept packed")
    if requested == "gguf":
        raise ValueError(f"quantization=gguf cannot apply here: {blocker}; use quantization=none.")
    return QuantizationChoice("none", f"GGUF tensors dequantized: {blocker}")


def load_weights(requested: str, target: LoadTarget, tp: Collectives | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Any, Any, QuantizationChoice, KernelOps]:
    """The model loaded as ``requested`` resolves for ``target`` (packed weights put in place
    on the meta device, so their float copies never exist), the HF config, the choice, and the
    kernel bundle to run it with (``target.ops``, wrapped to take packed weights when needed)."""
    from inflight.kernels.dispatch import with_quantized_linear
    from inflight.runtime.model import compressed_tensors
    from inflight.runtime.model.loader import load_model
    from inflight.runtime.model.quantized import install_gguf_linears, summarize_packed

    choice = resolve_quantization(requested, target)
    if target.stage is not None and choice.method != "none":
        raise ValueError(f"quantization={choice.method} cannot apply to a pipeline stage yet (packed weights are "
                         "installed for the whole model); use quantization=none or pipeline_parallel_size 1.")
    source = gguf_source(target.model_dir)

    def install(model: Any) -> frozenset[str]:
        if choice.method == "gguf" and source is not None:
            return install_gguf_linears(model, source, target.device, target.dtype)
        if choice.method == "compressed-tensors":
            return compressed_tensors.install_packed_linears(model, target.model_dir, target.hf_config, target.device)
        return frozenset()

    model, hf_config = load_model(target.model_dir, target.dtype, target.device, progress, target.hf_config, tp,
                                  install_packed=install, stage=target.stage)
    ops, detail = target.ops, ""
    if choice.method != "none":
        summary = summarize_packed(model)
        ops = with_quantized_linear(ops)
        detail = (f": {summary.num_quantized} linears, {summary.quantized_bytes / 2**20:.0f} MiB packed "
                  f"({summary.float32_bytes / 2**20:.0f} MiB as float32)")
    else:  # float32 on the native CPU kernels: linear weights prepacked for MKL's GEMM (cpu_packed)
        from inflight.kernels.cpu_prepack import prepack_detail

        # MKL's packed weights in one column block per thread a big step of this rank uses (as
        # the model runner sets them), so a few-row product streams each block on its own thread.
        threads = max(1, target.cpu_threads // (1 if tp is None else tp.world_size))
        detail = prepack_detail(model, ops.name, target.device, target.dtype, threads)
    if progress:
        progress(f"weights: quantization={choice.method} ({choice.why}){detail}")
    return model, hf_config, choice, ops
