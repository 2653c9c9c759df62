"""The decoder-layer stack of a pure-decode step as one native call (``cpu_decode_stack.h``).

:func:`decode_layer_stack` runs :func:`inflight.kernels.decode_stack.decode_layer_stack` as one
ctypes call (one GIL release for the whole step of a CPU decode lane). The products go through
MKL's packed GEMM exactly as ``torch.ops.mkl._mkl_linear`` runs them: ``cblas_sgemm_compute``
(row-major A, the packed B of ``_mkl_reorder_linear_weight``, bias copied into the output rows
and beta 1), its address taken from ``libtorch_cpu`` with ctypes and handed to C, the packed
buffers' addresses from ``torch.ops.mkldnn.data_ptr``. :func:`gemm_compute` checks that once per
process (a few products against ``_mkl_linear``, which must agree bit for bit): anything missing
or disagreeing and the call answers ``None``, so the decoder keeps its per-op path.

A stack's pointer table (one C struct per layer, :class:`StackLayerC`) is built on its first call
and kept on the :class:`~inflight.kernels.decode_stack.DecodeStack`, which holds every tensor
it points into. A weight's float copy, where it kept one, takes products of at most
``PANEL_MAX_ROWS`` rows through the panel kernel (``panels``) or ``FLOAT_COPY_MAX_ROWS`` through
the few-row kernel (``float_rows``), as ``cpu_native.linear`` does.
Knows nothing about the model or the engine.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from inflight.kernels import decode_stack
from inflight.kernels.cpu_packed import (
    FLOAT_COPY_MAX_ROWS,
    PANEL_MAX_ROWS,
    PackedLinearWeight,
    mkl_packing_available,
    pack_linear_weight,
    packed_linear,
)
from inflight.kernels.decode_block import DecodeRows

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "inflight_packed_gemm_f32": (None, [_ptr] * 5 + [_i64] * 3 + [_int]),
    "inflight_decode_stack_f32": (
        ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _f32] + [_ptr] * 4 + [_i64] * 3 + [_int, _i64, _i64]),
}


class StackLayerC(ctypes.Structure):
    """``inflight_stack_layer`` of cpu_decode_stack.h, field for field."""

    _fields_ = (
        [(name, _ptr) for name in ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w",
                                   "gate_up_b", "down_w", "down_b", "qkv_f", "o_f", "gate_up_f", "down_f",
                                   "qkv_p", "o_p", "gate_up_p", "down_p",
                                   "q_norm", "k_norm", "sinks", "cos_sin",
                                   "k_cache", "v_cache")]
        + [(name, _i64) for name in ("num_heads", "num_kv_heads", "head_dim", "rot_dim", "block_size", "window",
                                     "intermediate")]
        + [(name, _f32) for name in ("input_eps", "post_eps", "qk_eps", "scale")]
        + [("kv_bf16", _i64)]
    )  # fmt: skip


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _packed_addr(w: PackedLinearWeight) -> int | None:
    """MKL's table of packed column blocks (``cpu_weight_layout.mkl_table``); None for oneDNN's, which
    only takes products on the float copy here."""
    return w.mkl_table.data_ptr() if w.fmt == "mkl" and w.mkl_table is not None else None


def _torch_gemm_symbol() -> int | None:
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(lib.cblas_sgemm_compute, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


@lru_cache(maxsize=1)
def gemm_compute(lib: ctypes.CDLL) -> int | None:
    """The address of torch's ``cblas_sgemm_compute`` once it has been seen to give exactly what
    ``_mkl_linear`` gives (with and without a bias, one row and several); else None."""
    if not (mkl_packing_available() and hasattr(torch.ops.mkldnn, "data_ptr")):
        return None
    fn = _torch_gemm_symbol()
    if fn is None:
        return None
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(160, 24, generator=gen)
    for blocks in (1, 2):  # the blocks on one thread and on a team of two
        packed = pack_linear_weight(weight, num_blocks=blocks)
        if packed is None or len(packed.packed) != blocks:
            return None
        for rows, bias, threads in ((1, None, 1), (5, torch.randn(160, generator=gen), 2), (37, None, 2)):
            x = torch.randn(rows, 24, generator=gen)
            out = torch.empty(rows, 160)
            lib.inflight_packed_gemm_f32(fn, x.data_ptr(), _packed_addr(packed), _addr(bias), out.data_ptr(), rows,
                                         160, 24, threads)
            if not torch.equal(out, packed_linear(x, packed, bias)):
                return None
    return fn


def _table(stack: decode_stack.DecodeStack) -> ctypes.Array[StackLayerC]:
    table = (StackLayerC * len(stack.layers))()
    for entry, layer in zip(table, stack.layers, strict=True):
        a = layer.attention
        k_cache, v_cache = layer.kv_cache
        entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        entry.qkv_w, entry.qkv_b = _packed_addr(layer.qkv), _addr(layer.qkv_bias)
        entry.o_w, entry.o_b = _packed_addr(layer.o_proj), _addr(layer.o_bias)
        entry.gate_up_w, entry.gate_up_b = _packed_addr(layer.gate_up), _addr(layer.gate_up_bias)
        entry.down_w, entry.down_b = _packed_addr(layer.down), _addr(layer.down_bias)
        entry.qkv_f, entry.o_f = _addr(layer.qkv.float_rows), _addr(layer.o_proj.float_rows)
        entry.gate_up_f, entry.down_f = _addr(layer.gate_up.float_rows), _addr(layer.down.float_rows)
        entry.qkv_p, entry.o_p = _addr(layer.qkv.panels), _addr(layer.o_proj.panels)
        entry.gate_up_p, entry.down_p = _addr(layer.gate_up.panels), _addr(layer.down.panels)
        entry.q_norm, entry.k_norm, entry.sinks = _addr(a.q_norm), _addr(a.k_norm), _addr(a.sinks)
        entry.cos_sin, entry.k_cache, entry.v_cache = layer.cos_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        entry.num_heads, entry.num_kv_heads, entry.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        entry.rot_dim, entry.block_size, entry.window = layer.cos_sin.shape[1], k_cache.shape[1], a.sliding_window or 0
        entry.intermediate = layer.down.shape[1]
        entry.input_eps, entry.post_eps, entry.qk_eps, entry.scale = (layer.input_eps, layer.post_eps, a.norm_eps,
                                                                       a.scale)  # fmt: skip
        entry.kv_bf16 = int(k_cache.dtype == torch.bfloat16)
    return table


def decode_layer_stack(
    lib: ctypes.CDLL,
    hidden: torch.Tensor,  # [num_seqs, hidden] float32
    rows: DecodeRows,
    stack: decode_stack.DecodeStack,
) -> torch.Tensor | None:  # [num_seqs, hidden], final-normed
    """:func:`inflight.kernels.decode_stack.decode_layer_stack` as one call of ``lib``'s
    ``inflight_decode_stack_f32``; None for input it does not take (more rows than
    ``stack.max_rows``), or when the stack has MKL weights and MKL's packed GEMM cannot be
    reached from C (the caller then runs its per-op path)."""
    gemm = gemm_compute(lib) if stack.has_mkl_weights else None
    if stack.has_mkl_weights and gemm is None:
        return None
    num_seqs = hidden.shape[0]
    if not ((stack.max_rows is None or num_seqs <= stack.max_rows) and hidden.dim() == 2
            and hidden.shape[1] == stack.hidden and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
            and hidden.is_contiguous() and num_seqs == rows.positions.shape[0] and num_seqs > 0):  # fmt: skip
        return None
    table = stack.native
    if table is None:
        table = stack.native = _table(stack)
    out = torch.empty_like(hidden)
    tables = rows.block_tables
    status = lib.inflight_decode_stack_f32(
        table, len(stack.layers), gemm, hidden.data_ptr(), out.data_ptr(), stack.final_norm.data_ptr(),
        stack.final_eps, rows.positions.data_ptr(), rows.slot_mapping.data_ptr(), tables.data_ptr(),
        rows.context_lens.data_ptr(), num_seqs, stack.hidden, tables.shape[1], torch.get_num_threads(),
        FLOAT_COPY_MAX_ROWS, PANEL_MAX_ROWS,
    )
    if status != 0:
        raise MemoryError("decode_layer_stack: no memory for the scratch")
    return out
