"""Triton fused SwiGLU activation: ``silu(gate) * up`` from the fused gate/up projection.

Owns ``silu_and_mul`` (the reference's signature and rounding points: SiLU in float32
rounded to the input dtype, then the product rounded again). Eager torch runs this as two
strided elementwise kernels over the two halves of ``gate_up``, each a full pass over
memory; this is one pass that reads each half once and writes the result once. Knows
nothing about the model beyond the [num_tokens, 2 * intermediate] layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import FLOAT_DTYPES, cdiv, check_dtype, check_ndim

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]: gate columns, then up columns
    out_ptr,  # [num_tokens, d] contiguous
    stride_x,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * d + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, d]
    """``silu(gate_up[:, :d]) * gate_up[:, d:]`` for ``gate_up`` of shape [num_tokens, 2 * d]."""
    check_ndim("gate_up", gate_up, 2, "[num_tokens, 2 * intermediate]")
    check_dtype("gate_up", gate_up, FLOAT_DTYPES)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (got {gate_up.shape[1]}).")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    num_tokens, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and d:
        _silu_and_mul_kernel[(num_tokens, cdiv(d, BLOCK))](gate_up, out, gate_up.stride(0), d, BLOCK=BLOCK)
    return out
