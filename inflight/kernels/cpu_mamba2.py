"""Mamba-2's SSD scan on the CPU with its decode rows in native C (``cpu_mamba2.c``).

:func:`ssd_scan` has the signature of :func:`inflight.kernels.mamba2_reference.ssd_scan`: the
leading one-token sequences of the packed batch (the decode rows) take the C one-step update
(:func:`decode_step`: each head's state slice decayed, updated and read in one pass, rows and
heads across OpenMP threads); prompt chunks take the reference's chunked form. Anything the C
code does not take (no compiler, another device, a state not in contiguous float32) runs the
reference whole. Built with cpu_native's flags into the same cache. Knows nothing about models or
scheduling.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import cpu_native, mamba2_reference
from inflight.kernels.gated_delta import num_single

SOURCE = Path(__file__).with_name("cpu_mamba2.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {"inflight_mamba2_decode_f32": (_int, [_ptr] * 10 + [_i64] * 5)}
MAX_STATE = 4096  # the C code's stack buffer


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernel and where it came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_mamba2", _SIGNATURES, ("-lm",))


def decode_step(
    x: torch.Tensor,  # [n, num_heads, head_dim]
    dt: torch.Tensor,  # [n, num_heads]
    A: torch.Tensor,  # [num_heads]
    B: torch.Tensor,  # [n, num_groups, d_state]
    C: torch.Tensor,  # [n, num_groups, d_state]
    D: torch.Tensor,  # [num_heads]
    state: torch.Tensor,  # [num_slots, num_heads, head_dim, d_state] float32, updated in place
    slots: torch.Tensor,  # [n] int64, distinct
    has_initial: torch.Tensor,  # [n] bool
) -> torch.Tensor:  # [n, num_heads, head_dim] float32
    """``n`` one-token sequences through the C update (``RuntimeError`` when it is not built)."""
    lib = load_library()[0]
    if lib is None:
        raise RuntimeError(f"cpu_mamba2 is not built: {load_library()[1]}")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("state must be a contiguous float32 tensor")
    n, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    tensors = [t.float().contiguous() for t in (x, dt, A, B, C, D)]
    slots64 = slots.to(torch.int64).contiguous()
    init = has_initial.to(torch.uint8).contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.float32)
    ptrs = [t.data_ptr() for t in (*tensors, state, out, slots64, init)]
    if lib.inflight_mamba2_decode_f32(*ptrs, n, heads, head_dim, groups, d_state) != 0:
        raise ValueError(f"cpu_mamba2 cannot take {heads} heads in {groups} groups with a {d_state}-wide state")
    return out


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in x's dtype
    """See the module docstring and :func:`inflight.kernels.mamba2_reference.ssd_scan`."""
    if (load_library()[0] is None or x.device.type != "cpu" or state.dtype != torch.float32
            or not state.is_contiguous() or B.shape[-1] > MAX_STATE):  # fmt: skip
        return mamba2_reference.ssd_scan(x, dt, A, B, C, D, state, query_start_loc, slots, has_initial)
    bounds = query_start_loc.tolist()
    n = num_single(bounds)
    if n == 0:
        return mamba2_reference.ssd_scan(x, dt, A, B, C, D, state, query_start_loc, slots, has_initial)
    out = torch.empty(x.shape, dtype=x.dtype)
    out[:n] = decode_step(x[:n], dt[:n], A, B[:n], C[:n], D, state, slots[:n], has_initial[:n]).to(x.dtype)
    if n < len(bounds) - 1:
        rest = query_start_loc[n:] - bounds[n]
        out[n:] = mamba2_reference.ssd_scan(x[n:], dt[n:], A, B[n:], C[n:], D, state, rest, slots[n:],
                                            has_initial[n:])  # fmt: skip
    return out
