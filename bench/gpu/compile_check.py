"""``python -m bench.gpu.compile_check``: compile every Triton kernel for a GPU target
without a GPU (Triton's ahead-of-time path down to a cubin), and report the PTX's global
load widths.

Owns the kernels' representative launch signatures (dtypes, constexprs, 16-byte alignment
hints as Triton's launcher would specialize them). The interpreter tests prove the
kernels' arithmetic; this proves the same source lowers for the hardware (dot shapes,
loop-carried types, early returns) and that K/V loads vectorize. Must run without
``TRITON_INTERPRET`` (the kernels must be real ``JITFunction`` objects). Times nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

FLOAT_ARGS = ("qk_scale", "eps", "k_inv", "v_inv", "k_scale", "v_scale")
# fp8 (e4m3) KV caches: the kernels' constexprs (inflight/kernels/triton_fp8.py) and a float cache's
FP8_KV = {"KV_FP8": True, "MANT": 3, "BIAS": 7, "SUB_STEP": 2.0**-9}
FLOAT_KV = {"KV_FP8": False, "MANT": 0, "BIAS": 0, "SUB_STEP": 0.0}
FP8_STORE = {"KV_FP8": True, "MANT": 3, "BIAS": 7, "MAX_VALUE": 448.0, "MIN_NORMAL": 2.0**-6, "SUB_INV": 2.0**9}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One representative launch: pointer dtypes, constexprs, launch options."""

    name: str
    kernel: Any  # a triton JITFunction
    pointers: dict[str, str]  # arg name -> Triton pointer type, e.g. "*bf16"
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    unaligned: tuple[str, ...] = field(default=())  # int args Triton would not see as % 16


ELEM_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _specs(dtype: str, head_dim: int = 128, block_size: int = 16) -> list[KernelSpec]:
    """Launches as the wrappers would make them for a Llama-like layer (GQA 4, 8 KV heads)."""
    from inflight.kernels import triton_activation as act
    from inflight.kernels import triton_kv_store as kv
    from inflight.kernels import triton_norm_rope as nr

    p = f"*{dtype}"
    cache = {"k_cache_ptr": p, "v_cache_ptr": p}
    return [
        KernelSpec("store_kv", kv._store_kv_kernel,
                   {"key_ptr": p, "value_ptr": p, **cache, "slot_ptr": "*i64"},
                   {"BLOCK_SIZE": block_size, "BLOCK_H": 8, "BLOCK_D": head_dim, "KV_FP8": False, "MANT": 0,
                    "BIAS": 0, "MAX_VALUE": 0.0, "MIN_NORMAL": 0.0, "SUB_INV": 0.0}),
        KernelSpec("store_kv_fp8", kv._store_kv_kernel,
                   {"key_ptr": p, "value_ptr": p, "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "slot_ptr": "*i64"},
                   {"BLOCK_SIZE": block_size, "BLOCK_H": 8, "BLOCK_D": head_dim, **FP8_STORE}),
        *_attention_specs(dtype, head_dim, block_size),
        KernelSpec("rms_norm", nr._rms_norm_kernel,
                   {"x_ptr": p, "residual_ptr": p, "weight_ptr": p, "out_ptr": p,
                    "new_residual_ptr": p},
                   {"HAS_RESIDUAL": True, "BLOCK": 4096}, num_warps=8),
        KernelSpec("rotary", nr._rotary_kernel,
                   {"positions_ptr": "*i64", "q_ptr": p, "k_ptr": p, "cos_sin_ptr": "*fp32",
                    "q_out_ptr": p, "k_out_ptr": p},
                   {"HALF": head_dim // 2, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": head_dim}),
        KernelSpec("silu_and_mul", act._silu_and_mul_kernel, {"x_ptr": p, "out_ptr": p},
                   {"BLOCK": act.BLOCK}),
        *_quant_specs(dtype),
        *_intq_specs(dtype),
        *_lora_specs(dtype),
        *_mla_specs(dtype, block_size),
        *_gated_delta_specs(dtype),
        *_mamba2_specs(dtype),
    ]  # fmt: skip


def _gated_delta_specs(dtype: str) -> list[KernelSpec]:
    """Qwen3-Next's linear attention (kernels/triton_gated_delta.py) at its widths: the causal conv
    (4 taps) and the chunked delta rule over 128 x 128 heads."""
    from inflight.kernels import triton_causal_conv as conv
    from inflight.kernels import triton_gated_delta as gd

    p = f"*{dtype}"
    seqs = {"qsl_ptr": "*i32", "slots_ptr": "*i64", "init_ptr": "*i32"}
    return [
        KernelSpec("gated_delta_conv", conv._conv_kernel,
                   {"x_ptr": p, "w_ptr": p, "b_ptr": p, "state_ptr": p, "out_ptr": p, **seqs},
                   {"TAPS": 4, "BLOCK": conv.BLOCK_C, "HAS_BIAS": False}, unaligned=("sw", "ss0", "ss1")),
        KernelSpec("gated_delta_chunk", gd._chunk_rule_kernel,
                   {"q_ptr": p, "k_ptr": p, "v_ptr": p, "g_ptr": "*fp32", "b_ptr": p, "state_ptr": "*fp32",
                    "out_ptr": p, **seqs},
                   {"BK": 128, "BV": gd.BLOCK_V, "BT": gd.CHUNK_T}, unaligned=("group",)),
    ]  # fmt: skip


def _mamba2_specs(dtype: str) -> list[KernelSpec]:
    """Granite 4's Mamba-2 layers (kernels/triton_mamba2.py) at its widths: the causal conv with a
    bias (4 taps) and the chunked SSD scan over 64-feature heads with a 128-wide state."""
    from inflight.kernels import triton_causal_conv as conv
    from inflight.kernels import triton_mamba2 as m2

    p = f"*{dtype}"
    seqs = {"qsl_ptr": "*i32", "slots_ptr": "*i64", "init_ptr": "*i32"}
    return [
        KernelSpec("mamba2_conv", conv._conv_kernel,
                   {"x_ptr": p, "w_ptr": p, "b_ptr": p, "state_ptr": p, "out_ptr": p, **seqs},
                   {"TAPS": 4, "BLOCK": conv.BLOCK_C, "HAS_BIAS": True}, unaligned=("sw", "ss0", "ss1")),
        KernelSpec("mamba2_chunk", m2._chunk_scan_kernel,
                   {"x_ptr": p, "dt_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": p, "c_ptr": p, "d_ptr": "*fp32",
                    "state_ptr": "*fp32", "out_ptr": p, **seqs},
                   {"BP": m2.BLOCK_P, "BN": 128, "BT": m2.CHUNK_T}, unaligned=("per_group",)),
    ]  # fmt: skip


def _mla_specs(dtype: str, block_size: int) -> list[KernelSpec]:
    """The absorbed MLA decode (kernels/triton_mla_decode.py) at DeepSeek-V3's widths: latent 512,
    rope 64, 16 heads a program; direct and split over the context, and the splits' merge; and the
    absorbed prefill (kernels/triton_mla_prefill.py) as it launches for 16 heads a rank."""
    from inflight.kernels import triton_mla_decode as mla
    from inflight.kernels import triton_mla_prefill as mla_prefill

    p = f"*{dtype}"
    ptrs = {"q_latent_ptr": p, "q_pe_ptr": p, "latent_ptr": p, "pe_ptr": p, "block_tables_ptr": "*i32",
            "context_lens_ptr": "*i32", "out_ptr": p, "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}
    tiles = {"BLOCK_SIZE": block_size, "BLOCK_H": 16, "BLOCK_C": 512, "BLOCK_R": 64, "BLOCK_N": mla.BLOCK_N,
             "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "DOT_UPCAST": False}
    ragged = ("num_heads", "num_splits", "split_size")
    return [
        KernelSpec("mla_decode", mla._mla_decode_kernel, ptrs, {**tiles, "DIRECT": True}, unaligned=ragged),
        KernelSpec("mla_decode_split", mla._mla_decode_kernel, ptrs, {**tiles, "DIRECT": False}, unaligned=ragged),
        KernelSpec("mla_merge", mla._mla_merge_kernel, {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": p},
                   {"BLOCK_P": 16, "BLOCK_C": 512}, unaligned=ragged),
        KernelSpec("mla_prefill", mla_prefill._mla_prefill_kernel,  # the absorbed prefill: 2 queries x 16 heads
                   {"q_latent_ptr": p, "q_pe_ptr": p, "latent_ptr": p, "pe_ptr": p, "block_tables_ptr": "*i32",
                    "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32", "out_ptr": p},
                   {**{k: v for k, v in tiles.items() if k != "BLOCK_H"}, "BLOCK_M": 2, "BLOCK_H": 16},
                   num_warps=8, unaligned=("num_seqs", "num_heads")),
    ]  # fmt: skip


def _quant_specs(dtype: str) -> list[KernelSpec]:
    """The GGUF linear for every type (a 4096 x 4096 projection), alternating the many-row
    GEMM plan and the decode plan (split-K partials), and the split-K sum."""
    from inflight.kernels import triton_quant as tq
    from inflight.kernels.quant_reference import BLOCK_BYTES, BLOCK_WEIGHTS, QTYPE_IDS

    p = f"*{dtype}"
    ragged = ("M", "N", "row_bytes", "blocks_per_split", "num_elements", "split_k")
    specs = []
    for i, qtype in enumerate(tq.QTYPES):
        plan = tq.plan_quant_linear(1 if i % 2 else 512, 4096, 4096, sms=132)
        specs.append(KernelSpec(
            f"quant_{qtype.lower()}", tq._quant_linear_kernel,
            {"x_ptr": p, "quants_ptr": "*u8", "halves_ptr": "*fp16", "bias_ptr": p,
             "out_ptr": "*fp32" if plan.split_k > 1 else p},
            {"QTYPE": QTYPE_IDS[qtype], "BLOCK_BYTES": BLOCK_BYTES[qtype],
             "SUB_BLOCKS": BLOCK_WEIGHTS[qtype] // 32, "HAS_BIAS": plan.split_k == 1,
             "PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
             "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n},
            plan.num_warps, plan.num_stages, unaligned=ragged))
    specs.append(KernelSpec("quant_reduce", tq._sum_splits_kernel,
                            {"partial_ptr": "*fp32", "bias_ptr": p, "out_ptr": p},
                            {"HAS_BIAS": True, "BLOCK": tq.REDUCE_BLOCK}, unaligned=ragged))
    return specs


def _intq_specs(dtype: str) -> list[KernelSpec]:
    """The compressed-tensors pack-quantized linear (a 4096 x 4096 projection): int4 group 128
    and int8 channel-wise on the decode plan (split-K partials), int4 group 32 with zero points
    and int4 group 8 (scales gathered per weight) on the many-row plan; scales fp16, bf16, fp32."""
    from inflight.kernels import triton_intq as ti

    p = f"*{dtype}"
    ragged = ("M", "N", "K", "row_words", "num_groups", "group_size", "steps_per_split", "num_steps")
    specs = []
    for name, bits, group, zero, scale, num_rows in (("intq_int4_g128", 4, 128, False, "*fp16", 1),
                                                     ("intq_int4_g32_zp", 4, 32, True, "*bf16", 512),
                                                     ("intq_int8_channel", 8, 4096, False, "*fp32", 1),
                                                     ("intq_int4_g8_zp", 4, 8, True, "*fp16", 512)):
        plan = ti.plan_intq_linear(num_rows, 4096, 4096, group, sms=132)
        specs.append(KernelSpec(
            name, ti._intq_linear_kernel,
            {"x_ptr": p, "packed_ptr": "*i32", "scale_ptr": scale, "zero_ptr": "*i8" if zero else scale,
             "bias_ptr": p, "out_ptr": "*fp32" if plan.split_k > 1 else p},
            {"BITS": bits, "HAS_ZERO": zero, "HAS_BIAS": plan.split_k == 1,
             "GROUP_STEP": group % plan.block_k == 0, "SOFT_BF16": False,
             "PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
             "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k},
            plan.num_warps, plan.num_stages, unaligned=ragged))
    return specs


def _lora_specs(dtype: str) -> list[KernelSpec]:
    """The multi-LoRA shrink and expand (8 slots of rank 16 on a 4096 -> 4096 projection, the
    output a column slice of a fused qkv output), unit strides specialized as Triton's launcher does."""
    from inflight.kernels import triton_lora as tl_lora

    p = f"*{dtype}"
    common = {"NUM_SLOTS": 8, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
              "BLOCK_M": tl_lora.BLOCK_M, "BLOCK_R": 16}
    ragged = ("num_tokens",)
    return [
        KernelSpec("lora_shrink", tl_lora._shrink_kernel,
                   {"x_ptr": p, "a_ptr": p, "shrunk_ptr": "*fp32", "sorted_rows_ptr": "*i32",
                    "block_slot_ptr": "*i32"},
                   {**common, "stride_xk": 1, "stride_ak": 1, "BLOCK_K": tl_lora.BLOCK_K}, unaligned=ragged),
        KernelSpec("lora_expand", tl_lora._expand_kernel,
                   {"shrunk_ptr": "*fp32", "b_ptr": p, "out_ptr": p, "sorted_rows_ptr": "*i32",
                    "block_slot_ptr": "*i32"},
                   {**common, "stride_br": 1, "stride_on": 1, "BLOCK_N": tl_lora.BLOCK_N, "SPLIT_K": 4},
                   unaligned=ragged),
    ]  # fmt: skip


def _attention_specs(dtype: str, head_dim: int, block_size: int) -> list[KernelSpec]:
    """Decode (split and direct), its merge, and prefill, with the planners' tile sizes."""
    from inflight.kernels import triton_decode_attention as dec
    from inflight.kernels import triton_prefill_attention as pf

    p = f"*{dtype}"
    decode = dec.plan_decode(32, 8, 4096, head_dim, sms=132)
    prefill = pf.plan_prefill(4096, 4, head_dim, ELEM_SIZE[dtype])
    attn = {
        "GROUP": 4,
        "BLOCK_D": head_dim,
        "BLOCK_SIZE": block_size,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "DOT_UPCAST": False,
        **FLOAT_KV,
    }
    ragged = ("num_seqs", "num_heads", "num_splits", "split_size", "num_tokens", "window")
    paged = {
        "q_ptr": p,
        "k_cache_ptr": p,
        "v_cache_ptr": p,
        "block_tables_ptr": "*i32",
        "context_lens_ptr": "*i32",
        "out_ptr": p,
        "sinks_ptr": "*fp32",
    }
    decode_ptrs = {**paged, "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"}
    fp8_cache = {"k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}
    ragged = (*ragged, "min_split")
    reduce_ptrs = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": p, "sinks_ptr": "*fp32",
                   "context_lens_ptr": "*i32"}
    return [
        *(KernelSpec(name, dec._decode_split_kernel, decode_ptrs,
                     {**attn, "BLOCK_G": 16, "BLOCK_N": decode.block_n, "DIRECT": direct, "HAS_SINKS": False,
                      "PER_ROW": per_row},
                     decode.num_warps, decode.num_stages, unaligned=ragged)
          for name, direct, per_row in (("decode_split", False, False), ("decode_direct", True, False),
                                        ("decode_per_row", False, True))),
        *(KernelSpec(name, dec._decode_reduce_kernel, reduce_ptrs,
                     {"BLOCK_P": 8, "BLOCK_D": head_dim, "BLOCK_N": decode.block_n, "HAS_SINKS": False,
                      "PER_ROW": per_row}, num_warps=2, unaligned=ragged)
          for name, per_row in (("decode_reduce", False), ("decode_reduce_row", True))),
        KernelSpec("prefill", pf._prefill_kernel, {**paged, "query_start_loc_ptr": "*i32"},
                   {**attn, "BLOCK_M": prefill.block_m, "BLOCK_N": prefill.block_n, "HAS_SINKS": False},
                   prefill.num_warps, prefill.num_stages, unaligned=ragged),
        KernelSpec("decode_fp8", dec._decode_split_kernel, {**decode_ptrs, **fp8_cache},
                   {**attn, **FP8_KV, "BLOCK_G": 16, "BLOCK_N": decode.block_n, "DIRECT": False, "HAS_SINKS": False,
                    "PER_ROW": True},
                   decode.num_warps, decode.num_stages, unaligned=ragged),
        KernelSpec("prefill_fp8", pf._prefill_kernel, {**paged, **fp8_cache, "query_start_loc_ptr": "*i32"},
                   {**attn, **FP8_KV, "BLOCK_M": prefill.block_m, "BLOCK_N": prefill.block_n, "HAS_SINKS": False},
                   prefill.num_warps, prefill.num_stages, unaligned=ragged),
    ]  # fmt: skip


def compile_spec(spec: KernelSpec, arch: int) -> dict[str, Any]:
    """Compile ``spec`` for ``sm_<arch>``; returns the PTX and Triton's metadata."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(spec.kernel.arg_names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = spec.pointers.get(name, "fp32" if name in FLOAT_ARGS else "i32")
        if name in spec.pointers or (name not in FLOAT_ARGS and name not in spec.unaligned):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(spec.kernel, signature, spec.constexprs, attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}


def load_widths(ptx: str) -> dict[str, int]:
    """Count of global loads by width in bits (``ld.global.v4.b32`` is 128)."""
    widths: dict[str, int] = {}
    for m in re.finditer(r"ld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.b(\d+)", ptx):
        bits = int(m.group(1) or 1) * int(m.group(2))
        widths[str(bits)] = widths.get(str(bits), 0) + 1
    return widths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.compile_check")
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80 or 90")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the compile check needs real JIT kernels", file=sys.stderr)
        return 2
    failed = 0
    for spec in _specs(args.dtype, args.head_dim, args.block_size):
        try:
            result = compile_spec(spec, args.arch)
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"{spec.name:<14} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        widths = " ".join(f"{b}b:{n}" for b, n in sorted(load_widths(result["ptx"]).items()))
        print(f"{spec.name:<14} ok  shared {result['shared']:>6} B  global loads {widths}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
