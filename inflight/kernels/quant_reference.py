"""GGUF block-quantized linear weights and their torch reference kernels.

A :class:`QuantizedWeight` keeps a ``[out_features, in_features]`` weight in the packed
blocks of a GGUF file, one row of blocks per output feature (32 weights a block):

* ``Q8_0`` (34 bytes): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.
* ``Q4_0`` (18 bytes): fp16 ``d``, 16 bytes of nibbles; weight ``i < 16`` is the low nibble
  of byte ``i``, weight ``i + 16`` its high nibble; ``w = d * (nibble - 8)``.
* ``Q4_1`` (20 bytes): fp16 ``d``, fp16 min ``m``, 16 bytes of nibbles as Q4_0;
  ``w = d * nibble + m``.

The reference dequantizes exactly as ``gguf.quants.dequantize`` does (float32 products, no
fused multiply-add), then calls ``F.linear``; the native kernels in
:mod:`inflight.kernels.cpu_quant` must agree with it up to summation order. Knows nothing
about GGUF files or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32
# qtype -> bytes per 32-weight block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the C kernels' codes


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight in GGUF blocks: ``blocks`` is ``[out_features, in_features / 32 * block bytes]`` uint8."""

    qtype: str
    blocks: torch.Tensor  # [out_features, row_bytes] uint8, contiguous
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized type {self.qtype!r}; supported: {', '.join(BLOCK_BYTES)}.")
        if self.in_features % BLOCK_SIZE:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {BLOCK_SIZE}.")
        row_bytes = self.in_features // BLOCK_SIZE * BLOCK_BYTES[self.qtype]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != row_bytes:
            raise ValueError(f"{self.qtype} blocks must be uint8 [out, {row_bytes}] (got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}).")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def _half(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [..., 1] float32
    return raw.contiguous().view(torch.float16).float()


def dequantize_blocks(qtype: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8 blocks -> ``[rows, in_features]`` float32 (gguf's arithmetic)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, in_features // BLOCK_SIZE, BLOCK_BYTES[qtype])
    d = _half(b[..., 0:2])  # [rows, nb, 1]
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, in_features)
    qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [rows, nb, 32]
    if qtype == "Q4_0":
        return (d * (q - 8.0)).reshape(rows, in_features)
    return (d * q + _half(b[..., 2:4])).reshape(rows, in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:  # [out_features, in_features] float32
    return dequantize_blocks(weight.qtype, weight.blocks, weight.in_features)


def quant_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    return F.linear(x, dequantize(weight).to(x.dtype), None if bias is None else bias.to(x.dtype))


def quant_embedding(ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # [num_ids, in_features]
    """Rows ``ids`` of the weight, dequantized (an embedding table kept in GGUF blocks)."""
    return dequantize_blocks(weight.qtype, weight.blocks[ids.reshape(-1)], weight.in_features)
