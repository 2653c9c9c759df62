"""Native CPU kernels: builds ``cpu_kernels.c`` once per machine and binds it with ctypes.

``CPU_OPS`` has the reference signatures. Each wrapper runs the C kernel for float32
tensors in the layouts the decoder produces (rows of heads contiguous, any token stride;
few-row matmuls) and calls the torch reference for anything else (other dtypes, odd layouts,
bigger matmuls), so results never depend on which one ran beyond float rounding. ``linear``
(:mod:`.cpu_linear`) also takes weights prepacked at load for MKL's or oneDNN's GEMM
(:mod:`.cpu_packed`), at every row count (few-row products on the weight's float copy where it
kept one);
a pure-decode step's whole layer stack over such weights is one call (:mod:`.cpu_stack`).
fp8 KV caches take the fp8 store and attention kernels (:mod:`.cpu_fp8_kv`), with the layer's
``k_scale``/``v_scale``; the one-call block and stack read float caches only.

The library is compiled with the system C compiler (``$CC``, else ``cc``, else ``gcc``) into
``kernels/`` under :func:`inflight.cache.cache_root`, keyed by the source and the headers it
includes, the flags, the CPU model and the compiler, and written atomically so concurrent
processes (tensor-parallel ranks, test workers) share one build. :func:`load_library`
returns the reason instead of raising when no compiler is usable; the dispatcher decides
what to do with it. Knows nothing about the model or the engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch

from inflight.cache import cache_root
from inflight.kernels import (
    cpu_bf16_kv,
    cpu_fp8_kv,
    cpu_linear,
    cpu_mla,
    cpu_prefill,
    cpu_stack,
    decode_block,
    decode_stack,
    fp8_kv,
    lora_cpu,
    reference,
)
from inflight.kernels.cpu_prepack import cpuinfo_line
from inflight.kernels.fp8_kv import Scale
from inflight.kernels.ops import KernelOps

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_LOCK = threading.Lock()

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_paged_decode_attention_f32": (
        ctypes.c_int, [_ptr] * 6 + [_i64] * 6 + [_f32, _int, _i64, _ptr]),
    "inflight_store_kv_cache_f32": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int]),
    "inflight_paged_decode_attention_fp8": (
        ctypes.c_int, [_ptr] * 8 + [_i64] * 6 + [_f32, _int, _i64, _ptr]),
    "inflight_store_kv_cache_fp8": (
        None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _f32, _int, _int, _f32, _int]),
    "inflight_dequantize_fp8_blocks": (None, [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _int]),
    "inflight_paged_decode_attention_bf16": (
        ctypes.c_int, [_ptr] * 6 + [_i64] * 6 + [_f32, _int, _i64, _ptr]),
    "inflight_store_kv_cache_bf16": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int]),
    "inflight_widen_bf16_blocks": (None, [_ptr, _ptr, _i64, _i64, _ptr, _int]),
    "inflight_rms_norm_f32": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int]),
    "inflight_rotary_embedding_f32": (None, [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
    "inflight_small_m_linear_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "inflight_panel_linear_f32": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "inflight_silu_and_mul_f32": (None, [_ptr, _i64, _ptr, _i64, _i64, _int]),
    "inflight_decode_attention_block_f32": (
        ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _f32] + [_ptr] * 6 + [_i64] * 6
        + [_f32, _int, _i64, _ptr]),
    "inflight_decode_attention_block_bf16": (
        ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _f32] + [_ptr] * 6 + [_i64] * 6
        + [_f32, _int, _i64, _ptr]),
    **cpu_stack.SIGNATURES,
    **cpu_prefill.SIGNATURES,
}


def _cpu_model() -> str:
    line = cpuinfo_line("model name", "flags")
    return platform.processor() if line is None else line


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path, libs: tuple[str, ...]) -> str | None:
    """Compile ``source`` into ``target`` atomically; the compiler's complaint on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, str(source), "-o", tmp, *libs],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return f"{compiler} failed: {(proc.stderr or proc.stdout).strip()[-400:]}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile_library(source: Path, stem: str, signatures: dict[str, tuple[Any, list[Any]]],
                    libs: tuple[str, ...] = (), extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """``source`` compiled once per source, flags, CPU model and compiler into the cache
    (``<stem>-<machine>-<key>.so``) and loaded with ``signatures`` set; or ``(None, why not)``.
    ``extra_flags`` follow :data:`CFLAGS` (the tests build the 8-wide attention with
    ``-mno-avx512f``)."""
    flags = CFLAGS + extra_flags
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found (install gcc, or set CC)"
    text = source.read_bytes()
    headers = b"".join((source.parent / h.decode()).read_bytes()
                       for h in re.findall(rb'#include "([^"]+)"', text))  # a header edit rebuilds too
    key = hashlib.sha256(
        text + headers + " ".join(flags).encode() + _cpu_model().encode() + compiler.encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{stem}-{platform.machine()}-{key}.so"
    with _LOCK:
        if not target.exists():
            try:
                error = _build(compiler, flags, source, target, libs)
            except (OSError, subprocess.SubprocessError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                return None, error
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"cannot load {target}: {exc}"
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, str(target)


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels and where they came from, or ``(None, why not)``."""
    return compile_library(SOURCE, "cpu_kernels", _SIGNATURES, ("-lm",))


def _lib() -> ctypes.CDLL:
    lib, why = load_library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are not available: {why}")
    return lib


def _rows_ok(x: torch.Tensor) -> bool:
    """float32 on the CPU, ``[num_tokens, heads, head_dim]`` with heads and features packed."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    if fp8_kv.is_fp8(k_cache.dtype) or fp8_kv.is_fp8(v_cache.dtype):
        return cpu_fp8_kv.decode_attention(_lib(), query, k_cache, v_cache, block_tables, context_lens, scale,
                                             sliding_window, sinks, (k_scale, v_scale))  # fmt: skip
    if cpu_bf16_kv.is_bf16_of_float(k_cache.dtype, query.dtype):  # a float32 engine's bfloat16 cache
        return _decode_attention(_lib().inflight_paged_decode_attention_bf16, query, k_cache, v_cache, block_tables,
                                 context_lens, scale, sliding_window, sinks, cache_dtype=torch.bfloat16)  # fmt: skip
    return _decode_attention(_lib().inflight_paged_decode_attention_f32, query, k_cache, v_cache, block_tables,
                             context_lens, scale, sliding_window, sinks)


def decode_attention_from(source: Path, extra_flags: tuple[str, ...] = ()) -> Callable[..., torch.Tensor]:
    """``paged_decode_attention`` running the ``inflight_paged_decode_attention_f32`` of another
    build: ``source`` (same signature) and/or other flags. For A/B benchmarks and the tests."""
    name = "inflight_paged_decode_attention_f32"
    stem = f"decode_attention_{source.stem}" + "".join(f.strip("-").replace("=", "_") for f in extra_flags)
    lib, where = compile_library(source, stem, {name: _SIGNATURES[name]}, ("-lm",), extra_flags)
    if lib is None:
        raise RuntimeError(f"cannot build {source} with {extra_flags}: {where}")
    return partial(_decode_attention, getattr(lib, name))


def _decode_attention(
    kernel: Callable[..., int], query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None, *, cache_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if not (query.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == cache_dtype
            and query.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and query.device.type == "cpu"):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, sinks
        )
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}] (got {tuple(sinks.shape)}).")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    status = kernel(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1],
        scale, torch.get_num_threads(), sliding_window or 0, None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention: no memory for the per-thread scratch")
    return out


def decode_attention_block(
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]
    rows: decode_block.DecodeRows,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], fp32
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # [num_blocks, block_size, num_kv_heads, head_dim] each
    layer: decode_block.AttentionLayer,
) -> torch.Tensor:  # [num_seqs, num_heads * head_dim]
    """:func:`inflight.kernels.decode_block.decode_attention_block` as one native call (one
    allocation, one GIL release): float32 rows with features packed, any row stride."""
    k_cache, v_cache = kv_cache
    num_seqs, num_heads, head_dim = qkv.shape[0], layer.num_heads, layer.head_dim
    q_size, kv_size = num_heads * head_dim, layer.num_kv_heads * head_dim
    rot_dim = cos_sin_cache.shape[-1]
    q_norm, k_norm = layer.q_norm, layer.k_norm
    bf16_cache = cpu_bf16_kv.is_bf16_of_float(k_cache.dtype, qkv.dtype) and v_cache.dtype == k_cache.dtype
    if not (qkv.dim() == 2 and qkv.shape[1] == q_size + 2 * kv_size and qkv.stride(1) == 1
            and qkv.dtype == cos_sin_cache.dtype == torch.float32
            and (bf16_cache or k_cache.dtype == v_cache.dtype == torch.float32)
            and qkv.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cos_sin_cache.is_contiguous() and rot_dim % 2 == 0 and rot_dim <= head_dim
            and (q_norm is None) == (k_norm is None)
            and (q_norm is None or _vector_ok(q_norm, head_dim) and _vector_ok(k_norm, head_dim))):
        return decode_block.decode_attention_block(qkv, rows, cos_sin_cache, kv_cache, layer)
    sinks = layer.sinks
    if sinks is not None:
        sinks = decode_block.contiguous_as(sinks, torch.float32)
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}] (got {tuple(sinks.shape)}).")
    out = torch.empty((num_seqs, q_size), dtype=torch.float32)
    if num_seqs == 0:
        return out
    tables = rows.block_tables
    kernel = _lib().inflight_decode_attention_block_bf16 if bf16_cache else _lib().inflight_decode_attention_block_f32
    status = kernel(
        qkv.data_ptr(), qkv.stride(0), rows.positions.data_ptr(), cos_sin_cache.data_ptr(), rot_dim,
        None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
        layer.norm_eps, k_cache.data_ptr(), v_cache.data_ptr(), rows.slot_mapping.data_ptr(), tables.data_ptr(),
        rows.context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, layer.num_kv_heads, head_dim,
        k_cache.shape[1], tables.shape[1], layer.scale, torch.get_num_threads(), layer.sliding_window or 0,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("decode_attention_block: no memory for the per-thread scratch")
    return out


def decode_layer_stack(
    hidden: torch.Tensor, rows: decode_block.DecodeRows, stack: decode_stack.DecodeStack
) -> torch.Tensor | None:  # [num_seqs, hidden], final-normed; None: not taken
    """A pure-decode step's whole layer stack as one native call (:mod:`.cpu_stack`)."""
    return cpu_stack.decode_layer_stack(_lib(), hidden, rows, stack)


def _vector_ok(w: torch.Tensor | None, size: int) -> bool:
    return w is not None and w.dtype == torch.float32 and w.is_contiguous() and w.shape == (size,)


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    narrow = _rows_ok(key) and _rows_ok(value) and k_cache.is_contiguous() and v_cache.is_contiguous()
    if narrow and cpu_fp8_kv.store(_lib(), key, value, k_cache, v_cache, slot_mapping, (k_scale, v_scale)):
        return
    if narrow and cpu_bf16_kv.store(_lib(), key, value, k_cache, v_cache, slot_mapping):  # a float32 engine's
        return
    if not (_rows_ok(key) and _rows_ok(value) and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        reference.store_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    _lib().inflight_store_kv_cache_f32(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), key.shape[0], key.shape[1] * key.shape[2], torch.get_num_threads(),
    )


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    two_d = (x.dim() == 2 and x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1
             and weight.is_contiguous() and x.device.type == "cpu")
    if not two_d or (residual is not None and (residual.dtype != torch.float32 or residual.stride(-1) != 1
                                                or residual.shape != x.shape)):
        return reference.rms_norm(x, weight, eps, residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype)
    new_residual = x if residual is None else torch.empty((num_tokens, hidden), dtype=x.dtype)
    _lib().inflight_rms_norm_f32(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
        None if residual is None else new_residual.data_ptr(), num_tokens, hidden, eps,
        torch.get_num_threads(),
    )
    return out, new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_rows_ok(query) and _rows_ok(key) and cos_sin_cache.dtype == torch.float32
            and cos_sin_cache.is_contiguous()):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    pos = positions.to(torch.int64).contiguous()
    lib = _lib()
    rot_dim = cos_sin_cache.shape[1]
    outs = []
    for x in (query, key):
        out = torch.empty(x.shape, dtype=x.dtype)
        lib.inflight_rotary_embedding_f32(
            pos.data_ptr(), x.data_ptr(), x.stride(0), x.shape[1], x.shape[2],
            cos_sin_cache.data_ptr(), rot_dim, out.data_ptr(), x.shape[0], torch.get_num_threads(),
        )
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, d]
    """SwiGLU ``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * d] (gate, then up) in one pass."""
    if not (gate_up.dim() == 2 and gate_up.dtype == torch.float32 and gate_up.stride(1) == 1
            and gate_up.shape[1] % 2 == 0 and gate_up.device.type == "cpu"):
        return reference.silu_and_mul(gate_up)
    num_tokens, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=torch.float32)
    if num_tokens and d:
        _lib().inflight_silu_and_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), num_tokens, d,
                                         torch.get_num_threads())
    return out


paged_prefill_attention = cpu_prefill.bound_to(_lib)
linear = cpu_linear.bound_to(_lib)
lora_delta = lora_cpu.bound_to(compile_library)  # the multi-LoRA delta (issue 49)
paged_mla_decode, paged_mla_prefill = cpu_mla.bound_to(compile_library)  # DeepSeek-V3's absorbed MLA (issue 52)


# The native bundle. The dispatcher hands it out only after load_library() succeeded.
CPU_OPS = KernelOps(
    name="cpu-native",
    store_kv_cache=store_kv_cache,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    linear=linear,
    silu_and_mul=silu_and_mul,
    graph_safe=True,
    decode_attention_block=decode_attention_block,
    decode_layer_stack=decode_layer_stack,
    lora_delta=lora_delta,
    paged_mla_decode=paged_mla_decode,
    paged_mla_prefill=paged_mla_prefill,
)
