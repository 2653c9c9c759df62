"""Per-layer scales of an fp8 KV cache: where each layer's ``k_scale``/``v_scale`` come from.

In order: the checkpoint's (``layers.N.self_attn.k_scale``/``v_scale``, the names vLLM and
llm-compressor write, also under ``k_proj``/``v_proj`` or ``attn``, or one ``kv_scale`` for both;
a compressed-tensors ``kv_cache_scheme`` checkpoint carries these tensors); else, with
``calculate_kv_scales``, the first prompt's K/V (K amax / 200, V amax / 100: vLLM's approach and
constants, headroom for later prompts' larger values; for a served engine that prompt is the
warm-up's); else 1.0, said in the log. The loader records what
the checkpoint has (:func:`checkpoint_scale`) on each layer's attention; :func:`configure` then
sets every layer for the cache dtype and returns the sentence for the log. A float cache is never
scaled (a checkpoint's scales are ignored, and said so). Knows nothing about kernels or the engine.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from inflight.kernels import fp8_kv

# Checkpoint tensors that hold KV-cache scales (and the query/probability scales of vLLM's fp8
# attention, which a float attention does not use): what each sets.
_SCALE_NAME = re.compile(
    r"^layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|attn)\.)?(k_scale|v_scale|kv_scale|q_scale|prob_scale)$"
)


def checkpoint_scale(name: str) -> tuple[int, str] | None:
    """``(layer index, "k_scale" | "v_scale" | "kv_scale" | "q_scale" | "prob_scale")`` for a
    checkpoint tensor (``model.`` prefix removed) that holds an attention scale; else None."""
    match = _SCALE_NAME.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def record(model: Any, layer: int, kind: str, part: Any) -> None:
    """Keep a checkpoint scale (a one-element safetensors slice) on layer ``layer``'s attention."""
    if not 0 <= layer < len(model.layers):
        raise ValueError(f"checkpoint KV scale for layer {layer}, but the model has {len(model.layers)} layers.")
    values = part[...].float().reshape(-1)
    if values.numel() != 1:  # per-head scales: a per-tensor cache takes their max (never saturates more)
        values = values.max().reshape(1)
    value = float(values[0])
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"checkpoint KV scale layers.{layer}.{kind} is {value}; it must be positive and finite.")
    scales = model.layers[layer].self_attn.checkpoint_kv_scales
    for key in ("k", "v") if kind == "kv_scale" else (kind[0],) if kind in ("k_scale", "v_scale") else ():
        scales[key] = value


def configure(model: Any, cache_dtype: torch.dtype, calculate: bool) -> str | None:
    """Set every layer's KV scales for a cache of ``cache_dtype``; the log's sentence (None: nothing to say)."""
    attns = [layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")]  # (hybrid: not linear ones)
    found = sum(1 for a in attns if {"k", "v"} <= a.checkpoint_kv_scales.keys())
    if not fp8_kv.is_fp8(cache_dtype):
        for a in attns:
            a.kv_scales, a.calculate_kv_scales = None, False
        dtype = str(cache_dtype).removeprefix("torch.")
        return None if not found else f"the checkpoint's KV scales are unused: the KV cache is stored in {dtype}"
    rest = "calculated from the first prompt's K/V" if calculate else "1.0"
    for a in attns:
        ours = a.checkpoint_kv_scales
        if {"k", "v"} <= ours.keys():
            a.kv_scales, a.calculate_kv_scales = (ours["k"], ours["v"]), False
        else:
            a.kv_scales, a.calculate_kv_scales = (1.0, 1.0), calculate
    fmt = str(cache_dtype).removeprefix("torch.")
    if found == len(attns):
        return f"fp8 KV cache ({fmt}): K/V scales from the checkpoint"
    if found:
        return f"fp8 KV cache ({fmt}): K/V scales from the checkpoint for {found} of {len(attns)} layers, {rest} for the rest"
    if calculate:
        return f"fp8 KV cache ({fmt}): K/V scales {rest} (--calculate-kv-scales)"
    return (f"fp8 KV cache ({fmt}): K/V scales 1.0 (the checkpoint has none and --calculate-kv-scales is off; "
            f"K/V values beyond +-{fp8_kv.FORMATS[cache_dtype].max_value:g} saturate)")


def pending(model: Any) -> bool:
    """Whether some layer still waits for its scales from the first prompt."""
    return any(layer.self_attn.calculate_kv_scales for layer in model.layers if hasattr(layer, "self_attn"))
