"""MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``, gpt-oss) dequantized at load.

An MXFP4 tensor ``X`` is stored as two: ``X_blocks`` ``[..., rows, G, 16]`` uint8, two FP4 (E2M1)
codes a byte (low nibble first), 32 values per group; and ``X_scales`` ``[..., rows, G]`` uint8,
one E8M0 exponent per group (value ``2 ** (scale - 127)``). Dequantized, row ``r`` holds the
``G * 32`` values ``fp4(code) * 2 ** (scale - 127)``, as transformers' ``integrations/mxfp4.py``
computes them, and a 3-D expert tensor ``[E, rows, G * 32]`` is then transposed to
``[E, G * 32, rows]``, the layout transformers (and its float checkpoints) hold gpt-oss's experts
in, so one reader (:mod:`.gpt_oss`) serves both. Only expert tensors are MXFP4 in gpt-oss;
anything else stored so is refused. Knows nothing about the decoder; the loader calls
:func:`dequantized_tensors` over its stream of checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

# FP4 E2M1 codes 0..15: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # values per E8M0 scale (16 bytes of blocks)


def is_mxfp4(config: Any) -> bool:
    """Whether the transformers config describes an MXFP4 checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G, 16]`` uint8 codes and ``[..., G]`` uint8 exponents -> ``[..., G * 32]`` values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype}).")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: "
                         f"expected [..., G, {GROUP_SIZE // 2}] and [..., G].")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty((*scales.shape, GROUP_SIZE), dtype=dtype)
    # Expert by expert (the leading dimension) to bound the float32 temporaries.
    flat_b = blocks.reshape(-1, *blocks.shape[-3:]) if blocks.dim() >= 3 else blocks[None]
    flat_s = scales.reshape(-1, *scales.shape[-2:]) if scales.dim() >= 2 else scales[None]
    flat_o = out.view(-1, *out.shape[-3:]) if out.dim() >= 3 else out[None]
    for i in range(flat_b.shape[0]):
        codes = flat_b[i].long()  # [rows, G, 16]
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)  # [rows, G, 32]
        exponent = flat_s[i].to(torch.int32) - 127  # [rows, G]
        flat_o[i] = torch.ldexp(values, exponent[..., None].float()).to(dtype)
    return out.flatten(-2)


class _Loaded:
    """A dequantized tensor behind the safetensors slice interface the loader reads through."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def dequantized_tensors(tensors: Iterator[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """``tensors`` with each ``X_blocks``/``X_scales`` pair (in any order, any shard) replaced by
    ``X`` dequantized to ``dtype`` (a 3-D expert tensor transposed, see the module docstring)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, part in tensors:
        base, suffix = _split_name(name)
        if suffix is None:
            yield name, part
            continue
        halves = pending.setdefault(base, {})
        halves[suffix] = part[:]
        if len(halves) < 2:
            continue
        del pending[base]
        values = dequantize(halves["blocks"], halves["scales"], dtype)
        if values.dim() != 3 or ".mlp.experts." not in base:
            raise ValueError(f"{base}: MXFP4 tensor of shape {tuple(values.shape)}; inflight dequantizes "
                             "MXFP4 only for gpt-oss's expert tensors [E, rows, G, 16].")
        yield base, _Loaded(values.transpose(1, 2))
    if pending:
        lone = ", ".join(f"{base}_{next(iter(halves))}" for base, halves in pending.items())
        raise ValueError(f"MXFP4 checkpoint tensors without their blocks/scales partner: {lone}.")


def _split_name(name: str) -> tuple[str, str | None]:
    for suffix in ("blocks", "scales"):
        if name.endswith(f"_{suffix}"):
            return name[: -len(suffix) - 1], suffix
    return name, None
