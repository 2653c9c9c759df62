"""GGUF block-quantized linear weights and their torch reference kernels.

A :class:`QuantizedWeight` keeps a ``[out_features, in_features]`` weight in the packed
blocks of a GGUF file, one row of blocks per output feature. The 32-weight types:

* ``Q8_0`` (34 bytes): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.
* ``Q4_0`` (18 bytes): fp16 ``d``, 16 bytes of nibbles; weight ``i < 16`` is the low nibble
  of byte ``i``, weight ``i + 16`` its high nibble; ``w = d * (nibble - 8)``.
* ``Q4_1`` (20 bytes): fp16 ``d``, fp16 min ``m``, 16 bytes of nibbles as Q4_0;
  ``w = d * nibble + m``.

The K-quants (llama.cpp's ``Q4_K_M``/``Q5_K_M`` files) use 256-weight super-blocks of eight
32-weight sub-blocks ``j`` (Q6_K: sixteen 16-weight scale groups):

* ``Q4_K`` (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of packed 6-bit scales ``sc[j]``
  and mins ``m[j]`` (:func:`_k4_scales_mins`), 128 nibble bytes: sub-block ``j`` is byte
  ``32 * (j // 2) + i``, low nibble for even ``j``, high for odd; ``w = (d * sc) * q - dmin * m``.
* ``Q5_K`` (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles (bit ``j`` of
  byte ``i`` is bit 4 of weight ``i`` of sub-block ``j``).
* ``Q6_K`` (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales,
  fp16 ``d`` last; ``w = (d * scale) * (q - 32)`` (bit placement in :func:`_dequantize_q6_k`).

The reference dequantizes exactly as ``gguf.quants.dequantize`` does (float32 products, no
fused multiply-add), then calls ``F.linear``; the native kernels in
:mod:`inflight.kernels.cpu_quant` must agree with it up to summation order. Knows nothing
about GGUF files or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32  # weights per block of Q4_0, Q4_1, Q8_0 (and per K-quant sub-block)
QK_K = 256  # weights per K-quant super-block
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# qtype -> weights per block, and bytes per block
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}  # the C kernels' codes


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` weights (a multiple of the block size)."""
    return in_features // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight in GGUF blocks: ``blocks`` is ``[out_features, in_features / block weights * block bytes]`` uint8."""

    qtype: str
    blocks: torch.Tensor  # [out_features, row_bytes] uint8, contiguous
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized type {self.qtype!r}; supported: {', '.join(BLOCK_BYTES)}.")
        block = BLOCK_WEIGHTS[self.qtype]
        if self.in_features % block:
            raise ValueError(f"{self.qtype} packs {block} weights a block: in_features {self.in_features} "
                             f"must be a multiple of {block} (keep this tensor in float otherwise).")
        nbytes = row_bytes(self.qtype, self.in_features)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != nbytes:
            raise ValueError(f"{self.qtype} blocks must be uint8 [out, {nbytes}] (got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}).")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def _half(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [..., 1] float32
    return raw.contiguous().view(torch.float16).float()


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes ``[..., 12]`` -> 6-bit scales and mins, each ``[..., 8]`` float32.

    Sub-blocks 0-3 keep scale and min in the low 6 bits of bytes ``j`` and ``j + 4``; sub-blocks
    4-7 take their low 4 bits from the nibbles of byte ``j + 4`` and their top 2 bits from the
    top bits of bytes ``j - 4`` (scale) and ``j`` (min)."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _dequantize_q45_k(qtype: str, b: torch.Tensor) -> torch.Tensor:  # [rows, nb, bytes] -> [rows, nb, 256]
    rows, nb = b.shape[0], b.shape[1]
    scales, mins = _k4_scales_mins(b[..., 4:16])
    ds = (_half(b[..., 0:2]) * scales).unsqueeze(-1)  # [rows, nb, 8, 1]
    dm = (_half(b[..., 2:4]) * mins).unsqueeze(-1)  # [rows, nb, 8, 1]
    nibbles = b[..., -128:].reshape(rows, nb, 4, 1, 32)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-2).reshape(rows, nb, 8, 32)
    if qtype == "Q5_K":
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(8, 1)
        high = (b[..., 16:48].reshape(rows, nb, 1, 32) >> shifts) & 1  # [rows, nb, 8, 32]
        q = q | (high << 4)
    return (ds * q.float() - dm).reshape(rows, nb, QK_K)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:  # [rows, nb, 210] -> [rows, nb, 256]
    """Weight ``e = 128 h + 32 t + i`` (half ``h``, quarter ``t``): low nibble ``t // 2`` of byte
    ``64 h + 32 (t % 2) + i``, high bits ``2 t, 2 t + 1`` of byte ``128 + 32 h + i``; scale
    ``e // 16``."""
    rows, nb = b.shape[0], b.shape[1]
    low = b[..., 0:128].reshape(rows, nb, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=-2).reshape(rows, nb, QK_K)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(4, 1)
    high = ((b[..., 128:192].reshape(rows, nb, 2, 1, 32) >> shifts) & 3).reshape(rows, nb, QK_K)
    q = (low | (high << 4)).float() - 32.0  # [rows, nb, 256], exact small integers
    d = _half(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [rows, nb, 16]
    return (d.unsqueeze(-1) * q.reshape(rows, nb, 16, 16)).reshape(rows, nb, QK_K)


def dequantize_blocks(qtype: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8 blocks -> ``[rows, in_features]`` float32 (gguf's arithmetic)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, in_features // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype])
    if qtype == "Q6_K":
        return _dequantize_q6_k(b).reshape(rows, in_features)
    if qtype in K_QUANTS:
        return _dequantize_q45_k(qtype, b).reshape(rows, in_features)
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
