"""Small ``@triton.jit`` helpers shared by the attention kernels.

Owns the one matmul wrapper the kernels use, so the interpreter work-around lives in one
place. Knows nothing about attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST`` (interpreter only) multiplies in fp32:
    Triton's interpreter multiplies bf16 operands as their raw uint16 bit patterns."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 inputs (no silent TF32); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def needs_upcast(device: torch.device) -> bool:
    """Off CUDA the kernels run in the interpreter, whose bf16 ``tl.dot`` is wrong."""
    return device.type != "cuda"
