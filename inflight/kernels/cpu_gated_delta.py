"""The gated delta rule on the CPU with its decode rows in native C (``cpu_gated_delta.c``).

:func:`gated_delta_rule` has the signature of :func:`inflight.kernels.gated_delta.gated_delta_rule`:
the leading one-token sequences of the packed batch (the decode rows) take the C one-token step
(each row's q/k normalised, its state slice decayed, corrected and read in one pass, rows and
heads across OpenMP threads); prompt chunks take the reference's chunked form (transformers'
numerics for prefill). Anything the C code does not take (no compiler, another device, a state
not in float32) runs the reference whole. Built with cpu_native's flags into the same cache.
Knows nothing about models or scheduling.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import cpu_native, gated_delta

SOURCE = Path(__file__).with_name("cpu_gated_delta.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {"inflight_gdn_decode_f32": (_int, [_ptr] * 9 + [_i64] * 5)}
MAX_K_DIM, MAX_V_DIM = 1024, 4096  # the C code's stack buffers


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernel and where it came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_gated_delta", _SIGNATURES, ("-lm",))


def decode_step(
    q: torch.Tensor,  # [n, num_k_heads, k_head_dim]
    k: torch.Tensor,
    v: torch.Tensor,  # [n, num_v_heads, v_head_dim]
    g: torch.Tensor,  # [n, num_v_heads]
    beta: torch.Tensor,
    state: torch.Tensor,  # [num_slots, num_v_heads, k_head_dim, v_head_dim] float32, updated in place
    slots: torch.Tensor,  # [n] int64, distinct
    has_initial: torch.Tensor,  # [n] bool
) -> torch.Tensor:  # [n, num_v_heads, v_head_dim] float32
    """``n`` one-token sequences through the C step (``RuntimeError`` when it is not built)."""
    lib = load_library()[0]
    if lib is None:
        raise RuntimeError(f"cpu_gated_delta is not built: {load_library()[1]}")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("state must be a contiguous float32 tensor")
    n, hk, dk = k.shape
    hv, dv = v.shape[1:]
    qf, kf, vf, gf, bf = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots64 = slots.to(torch.int64).contiguous()
    init = has_initial.to(torch.uint8).contiguous()
    out = torch.empty(n, hv, dv, dtype=torch.float32)
    ptrs = [t.data_ptr() for t in (qf, kf, vf, gf, bf, state, out, slots64, init)]
    if lib.inflight_gdn_decode_f32(*ptrs, n, hk, hv, dk, dv) != 0:
        raise ValueError(f"cpu_gated_delta cannot take heads {hk}/{hv} of {dk}/{dv} features")
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    query_start_loc: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_head_dim] in v's dtype
    """See the module docstring and :func:`inflight.kernels.gated_delta.gated_delta_rule`."""
    args = (query_start_loc, slots, has_initial)
    dk, dv = k.shape[-1], v.shape[-1]
    if (load_library()[0] is None or q.device.type != "cpu" or state.dtype != torch.float32
            or not state.is_contiguous() or dk > MAX_K_DIM or dv > MAX_V_DIM):  # fmt: skip
        return gated_delta.gated_delta_rule(q, k, v, g, beta, state, *args)
    bounds = query_start_loc.tolist()
    n = gated_delta.num_single(bounds)
    if n == 0:
        return gated_delta.gated_delta_rule(q, k, v, g, beta, state, *args)
    out = torch.empty(v.shape, dtype=v.dtype)
    out[:n] = decode_step(q[:n], k[:n], v[:n], g[:n], beta[:n], state, slots[:n], has_initial[:n]).to(v.dtype)
    if n < len(bounds) - 1:
        rest = query_start_loc[n:] - bounds[n]
        out[n:] = gated_delta.gated_delta_rule(q[n:], k[n:], v[n:], g[n:], beta[n:], state, rest, slots[n:],
                                               has_initial[n:])  # fmt: skip
    return out
