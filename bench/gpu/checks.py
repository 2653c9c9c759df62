"""GPU correctness pass of the benchmark: each Triton kernel against its torch reference.

Owns the random, realistically shaped inputs (Llama-like heads, ragged contexts, shuffled
blocks, prefix-cache hits) and the pass/fail table. Fresh random inputs on every run; nothing
here is timed. Knows nothing about the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.kernels import reference
from inflight.kernels.ops import KernelOps

TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    dtype: torch.dtype
    max_abs_err: float
    ok: bool
    error: str | None = None  # the exception the check raised, if any


def _paged(
    lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, context_lens) with shuffled blocks on ``device``."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 8
    order = torch.randperm(num_blocks)
    table = torch.randint(0, num_blocks, (len(lens), max(needed) + 2))
    used = 0
    for s, n in enumerate(needed):
        table[s, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=dtype)
    v = torch.randn(shape, device=device, dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return k, v, table.int().to(device), lens_t


def _compare(
    name: str, got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype
) -> CheckResult:
    err = (got.float() - expected.float()).abs()
    bound = TOLERANCE[dtype] * (1 + expected.float().abs())
    ok = bool(torch.isfinite(got).all()) and bool((err <= bound).all())
    return CheckResult(name, dtype, float(err.max()) if err.numel() else 0.0, ok)


def _check_store(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    cache = torch.full((64, 16, 8, 128), float("nan"), device=device, dtype=dtype)
    key, value = (torch.randn(300, 8, 128, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(64 * 16, device=device)[:300]
    slots[7] = -1
    ref_k, ref_v, k, v = (cache.clone() for _ in range(4))
    reference.store_kv_cache(key, value, ref_k, ref_v, slots)
    ops.store_kv_cache(key, value, k, v, slots)
    return _compare(
        "store_kv_cache",
        torch.cat([k, v]).nan_to_num(7),
        torch.cat([ref_k, ref_v]).nan_to_num(7),
        dtype,
    )


def _check_decode(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    lens = [1, 16, 17, 255, 256, 1000, 4096, 3] + torch.randint(1, 3000, (24,)).tolist()
    k, v, table, lens_t = _paged(lens, 16, 8, 128, dtype, device)
    query = torch.randn(len(lens), 32, 128, device=device, dtype=dtype)
    args = (query, k, v, table, lens_t, 128**-0.5)
    got = ops.paged_decode_attention(*args)
    return _compare("paged_decode_attention", got, reference.paged_decode_attention(*args), dtype)


def _check_prefill(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    # (q_len, context_len): full prompts, later chunks / prefix hits, decodes riding along.
    chunks = [(512, 512), (100, 612), (1, 700), (257, 257), (64, 2112), (0, 40), (33, 33)]
    k, v, table, lens_t = _paged([c for _, c in chunks], 32, 4, 128, dtype, device)
    q_lens = torch.tensor([q for q, _ in chunks])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int().to(device)
    query = torch.randn(int(q_lens.sum()), 28, 128, device=device, dtype=dtype)
    args = (query, k, v, table, starts, lens_t, 128**-0.5)
    got = ops.paged_prefill_attention(*args)
    return _compare("paged_prefill_attention", got, reference.paged_prefill_attention(*args), dtype)


def _check_rms_norm(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    x, residual = (torch.randn(77, 4096, device=device, dtype=dtype) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(4096, device=device, dtype=dtype)
    got, got_res = ops.rms_norm(x, weight, 1e-6, residual)
    exp, exp_res = reference.rms_norm(x, weight, 1e-6, residual)
    return _compare(
        "rms_norm(+residual)", torch.cat([got, got_res]), torch.cat([exp, exp_res]), dtype
    )


def _check_rotary(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, device=device).float() / 128))
    angles = torch.arange(4096, device=device).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [4096, 128]
    positions = torch.randint(0, 4096, (333,), device=device)
    query = torch.randn(333, 32, 128, device=device, dtype=dtype)
    key = torch.randn(333, 8, 128, device=device, dtype=dtype)
    got = torch.cat([t.flatten(1) for t in ops.rotary_embedding(positions, query, key, cos_sin)], 1)
    exp = reference.rotary_embedding(positions, query, key, cos_sin)
    return _compare("rotary_embedding", got, torch.cat([t.flatten(1) for t in exp], 1), dtype)


def _check_silu_and_mul(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    gate_up = 3 * torch.randn(300, 2 * 8960, device=device, dtype=dtype)
    return _compare("silu_and_mul", ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), dtype)


def _gguf_weight(qtype: str, out_features: int, in_features: int, device: str) -> object:
    """Random GGUF blocks whose fp16 scales keep the weights near 0.05 in magnitude."""
    from inflight.kernels.quant_reference import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight

    num_blocks = in_features // BLOCK_WEIGHTS[qtype]
    blocks = torch.randint(0, 256, (out_features, num_blocks, BLOCK_BYTES[qtype]), dtype=torch.uint8)
    scale = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 5e-5}.get(qtype, 5e-3)
    for at in {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,)):
        half = (scale * (0.5 + torch.rand(out_features, num_blocks, 1))).half()
        blocks[..., at : at + 2] = (half - 0.04 if qtype == "Q4_1" and at == 2 else half).view(torch.uint8)
    return QuantizedWeight(qtype, blocks.reshape(out_features, -1).to(device), in_features)


def _check_quant_linear(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    """Every GGUF type through ``with_quantized_linear(ops).linear``, a decode row and a prefill."""
    from inflight.kernels import quant_reference
    from inflight.kernels.dispatch import with_quantized_linear

    linear = with_quantized_linear(ops).linear
    got, expected = [], []
    bias = torch.randn(1000, device=device, dtype=dtype)
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        weight = _gguf_weight(qtype, 1000, 2048, device)
        for num_rows in (1, 300):
            x = torch.randn(num_rows, 2048, device=device, dtype=dtype)
            got.append(linear(x, weight, bias))
            expected.append(quant_reference.quant_linear(x, weight, bias))
    return _compare("quant_linear(gguf)", torch.cat(got), torch.cat(expected), dtype)


def _intq_weight(num_bits: int, group_size: int, zero: bool, scale_dtype: torch.dtype, out_features: int,
                 in_features: int, device: str) -> object:
    """A random pack-quantized weight (every value occurs) whose scales keep it near 0.05."""
    from inflight.kernels.intq_reference import IntQuantWeight

    per_word = 32 // num_bits
    q = torch.randint(0, 1 << num_bits, (out_features, in_features // per_word, per_word), dtype=torch.int64)
    words = (q << (torch.arange(per_word) * num_bits)).sum(-1)  # [out, words] in [0, 2^32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    groups = (out_features, in_features // group_size)
    scale = ((0.5 + torch.rand(groups)) * 0.1 / (1 << num_bits)).to(scale_dtype)
    half = 1 << (num_bits - 1)
    zp = torch.randint(-half, half, groups).to(torch.int8).to(device) if zero else None
    return IntQuantWeight(packed.to(device), scale.to(device), in_features, num_bits, group_size, zp)


def _check_intq_linear(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    """compressed-tensors int4/int8 weights through ``with_quantized_linear(ops).linear``, a
    decode row and a prefill."""
    from inflight.kernels import intq_reference
    from inflight.kernels.dispatch import with_quantized_linear

    linear = with_quantized_linear(ops).linear
    got, expected = [], []
    bias = torch.randn(1000, device=device, dtype=dtype)
    for bits, group, zero, scale_dtype in ((4, 128, False, torch.float16), (4, 32, True, torch.bfloat16),
                                           (8, 2048, False, torch.bfloat16), (8, 128, True, torch.float32)):
        weight = _intq_weight(bits, group, zero, scale_dtype, 1000, 2048, device)
        for num_rows in (1, 300):
            x = torch.randn(num_rows, 2048, device=device, dtype=dtype)
            got.append(linear(x, weight, bias))
            expected.append(intq_reference.intq_linear(x, weight, bias))
    return _compare("intq_linear(ct)", torch.cat(got), torch.cat(expected), dtype)


def _check_lora(ops: KernelOps, dtype: torch.dtype, device: str) -> CheckResult:
    """Multi-LoRA deltas of 8 adapters (rank 64, the lower ranks padded with zeros) plus rows
    with none, into a column slice of a fused qkv output: a mixed step and a decode step."""
    from inflight.kernels import lora_reference

    in_features, q_features, width = 4096, 4096, 4096 + 2 * 1024
    a = torch.randn(8, 64, in_features, device=device, dtype=dtype) * in_features**-0.5
    b = torch.randn(8, q_features, 64, device=device, dtype=dtype) * 0.125
    for s, rank in enumerate((8, 16, 16, 32, 64, 64, 8, 16)):
        a[s, rank:], b[s, :, rank:] = 0, 0
    got, expected = [], []
    for num_rows in (300, 5):
        x = torch.randn(num_rows, in_features, device=device, dtype=dtype)
        slots = torch.randint(-1, 8, (num_rows,), device=device, dtype=torch.int32)
        fused = torch.randn(num_rows, width, device=device, dtype=dtype)
        ref = fused.clone()
        ops.lora_delta(x, a, b, slots, fused[:, :q_features])
        lora_reference.lora_delta(x, a, b, slots, ref[:, :q_features])
        got.append(fused)
        expected.append(ref)
    return _compare("lora_delta", torch.cat(got), torch.cat(expected), dtype)


CHECKS: tuple[Callable[[KernelOps, torch.dtype, str], CheckResult], ...] = (
    _check_store,
    _check_decode,
    _check_prefill,
    _check_rms_norm,
    _check_rotary,
    _check_silu_and_mul,
    _check_quant_linear,
    _check_intq_linear,
    _check_lora,
)


def run_checks(
    ops: KernelOps, dtypes: tuple[torch.dtype, ...], device: str = "cuda"
) -> list[CheckResult]:
    """Every kernel in every dtype on fresh random inputs on ``device`` (CUDA; the CPU only
    in the dry run of ``make gpu-check``); prints one line each."""
    results = []
    print(f"{'kernel':<26} {'dtype':<9} {'max |err|':>10}  result")
    for dtype in dtypes:
        for check in CHECKS:
            try:
                r = check(ops, dtype, device)
            except Exception as exc:  # one kernel's failure is its row, never the table's end
                name = check.__name__.removeprefix("_check_")
                r = CheckResult(name, dtype, float("nan"), False, f"{type(exc).__name__}: {exc}"[:300])
            results.append(r)
            verdict = "ok" if r.ok else f"FAIL ({r.error})" if r.error else "FAIL"
            print(f"{r.name:<26} {str(r.dtype)[6:]:<9} {r.max_abs_err:>10.2e}  {verdict}")
    return results
