"""compressed-tensors ``pack-quantized`` int4/int8 weights and their torch reference kernels.

An :class:`IntQuantWeight` keeps a ``[out_features, in_features]`` weight as llmcompressor
writes it for weight-only W4A16/W8A16 (GPTQ/AWQ-style) checkpoints and vLLM serves it:

* ``weight_packed``: ``[out, ceil(in * num_bits / 32)]`` int32. Input feature ``i`` of a row
  sits in word ``i * num_bits // 32`` at bit ``i * num_bits % 32`` (8 int4 or 4 int8 values a
  word, low bits first), stored unsigned: ``u = q + 2 ** (num_bits - 1)``.
* ``weight_scale``: ``[out, in / group_size]`` float16, bfloat16 or float32 (channel-wise:
  ``[out, 1]``, ``group_size == in_features``); groups run along ``in_features``.
* ``weight_zero_point``: asymmetric only, ``[out, in / group_size]`` int8 in the signed range
  of ``q``. Checkpoints store it packed along ``out_features``; :func:`unpack_zero_point` undoes
  that, so rows stay independent and fused projections are plain row concatenations.

``w = (q - zero_point) * scale``, computed exactly as compressed-tensors'
``PackedQuantizationCompressor.decompress`` does (in the scale's dtype: each product rounded
to it). The native kernels in :mod:`inflight.kernels.cpu_intq` must agree with
:func:`intq_linear` up to summation order. Knows nothing about checkpoints or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_BITS = (4, 8)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packed_words(num_values: int, num_bits: int) -> int:
    """int32 words that hold ``num_values`` values of ``num_bits`` each."""
    return -(-num_values * num_bits // 32)


@dataclass(frozen=True, slots=True)
class IntQuantWeight:
    """A pack-quantized weight (see the module docstring for the layout)."""

    weight_packed: torch.Tensor  # [out_features, ceil(in_features * num_bits / 32)] int32
    weight_scale: torch.Tensor  # [out_features, num_groups] float16 | bfloat16 | float32
    in_features: int
    num_bits: int  # 4 or 8
    group_size: int  # in_features when channel-wise
    weight_zero_point: torch.Tensor | None = None  # [out_features, num_groups] int8; None: symmetric

    def __post_init__(self) -> None:
        if self.num_bits not in NUM_BITS:
            raise ValueError(f"pack-quantized num_bits must be 4 or 8 (got {self.num_bits}).")
        if self.group_size < 1 or self.in_features % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide in_features {self.in_features}.")
        words = packed_words(self.in_features, self.num_bits)
        packed = self.weight_packed
        if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != words:
            raise ValueError(f"weight_packed must be int32 [out, {words}] for {self.in_features} int{self.num_bits} "
                             f"inputs (got {packed.dtype} {tuple(packed.shape)}).")
        groups = (packed.shape[0], self.in_features // self.group_size)
        if self.weight_scale.dtype not in SCALE_DTYPES or tuple(self.weight_scale.shape) != groups:
            raise ValueError(f"weight_scale must be float16/bfloat16/float32 {groups} (got "
                             f"{self.weight_scale.dtype} {tuple(self.weight_scale.shape)}).")
        zp = self.weight_zero_point
        if zp is not None and (zp.dtype != torch.int8 or tuple(zp.shape) != groups):
            raise ValueError(f"weight_zero_point must be int8 {groups}, unpacked "
                             f"(got {zp.dtype} {tuple(zp.shape)}); see unpack_zero_point.")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight_packed.shape[0]), self.in_features)

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    @property
    def symmetric(self) -> bool:
        return self.weight_zero_point is None

    @property
    def nbytes(self) -> int:
        tensors = (self.weight_packed, self.weight_scale, self.weight_zero_point)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def unpack_int32(packed: torch.Tensor, num_bits: int, num_values: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, num_values]`` int8 signed values (offset removed)."""
    per_word = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)  # [per_word]
    unsigned = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [rows, words, per_word]
    unsigned = unsigned.reshape(packed.shape[0], packed.shape[1] * per_word)[:, :num_values]
    return (unsigned - (1 << (num_bits - 1))).to(torch.int8)


def unpack_zero_point(packed: torch.Tensor, num_bits: int, out_features: int) -> torch.Tensor:
    """A checkpoint's ``weight_zero_point`` packed along ``out_features``
    (``[ceil(out * num_bits / 32), num_groups]`` int32) -> ``[out, num_groups]`` int8."""
    words = packed_words(out_features, num_bits)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != words:
        raise ValueError(f"a packed zero point must be int32 [{words}, num_groups] for {out_features} outputs "
                         f"(got {packed.dtype} {tuple(packed.shape)}).")
    return unpack_int32(packed.t().contiguous(), num_bits, out_features).t().contiguous()


def dequantize(weight: IntQuantWeight) -> torch.Tensor:  # [out_features, in_features] in the scale's dtype
    """The float weight, exactly as compressed-tensors decompresses it."""
    dtype = weight.weight_scale.dtype
    q = unpack_int32(weight.weight_packed, weight.num_bits, weight.in_features)
    w = q.to(dtype).unflatten(-1, (weight.num_groups, weight.group_size))  # [out, groups, group_size]
    if weight.weight_zero_point is not None:
        w = w - weight.weight_zero_point.to(dtype).unsqueeze(-1)
    return (w * weight.weight_scale.unsqueeze(-1)).flatten(start_dim=-2)


def intq_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: IntQuantWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    return F.linear(x, dequantize(weight).to(x.dtype), None if bias is None else bias.to(x.dtype))
