"""Triton fused RMSNorm(+residual) and rotary embedding against the torch references."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# (hidden, x dtype, weight dtype, with residual)
NORM_CASES = [
    (64, F32, F32, True),
    (96, BF16, BF16, True),
    (200, F16, F16, False),
    (128, BF16, F32, True),
]


@pytest.mark.parametrize(
    "case", NORM_CASES, ids=lambda c: f"h{c[0]}-{str(c[1])[6:]}-w{str(c[2])[6:]}-r{c[3]}"
)
def test_rms_norm_matches_reference(case, device, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_norm_rope import rms_norm

    hidden, dtype, weight_dtype, with_residual = case
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(weight_dtype).to(device)
    residual = torch.randn(5, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    got, got_residual = rms_norm(x, weight, 1e-6, residual)
    assert_close(got, expected, precision=dtype)  # normed is rounded to x's dtype first
    assert_close(got_residual, expected_residual)


def test_rms_norm_per_head_on_a_strided_view(device, poison_allocations, assert_close) -> None:
    """Qwen3's qk-norm: [num_tokens, num_heads, head_dim] views into the fused QKV output."""
    from inflight.kernels.triton_norm_rope import rms_norm

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 * 2) * 64, generator=gen).to(BF16).to(device)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    weight = (1 + 0.5 * torch.randn(64, generator=gen)).to(BF16).to(device)
    got, got_residual = rms_norm(q, weight, 1e-6)
    expected, _ = reference.rms_norm(q, weight, 1e-6)
    assert_close(got, expected)
    assert got_residual is q


def test_rms_norm_rejects_bad_weight(device) -> None:
    from inflight.kernels.triton_norm_rope import rms_norm

    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8, device=device), torch.randn(4, device=device), 1e-6)


def _cos_sin_cache(rotary_dim: int, max_position: int) -> torch.Tensor:  # [max_pos, rotary_dim]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


# (head_dim, rotary_dim, num_heads, num_kv_heads, dtype, positions dtype)
ROPE_CASES = [
    (64, 64, 4, 4, F32, torch.int64),
    (128, 128, 8, 2, BF16, torch.int64),
    (128, 64, 8, 1, F16, torch.int32),  # partial rotary: the tail passes through
    (64, 32, 4, 1, F32, torch.int64),
]


@pytest.mark.parametrize(
    "case", ROPE_CASES, ids=lambda c: f"d{c[0]}-rot{c[1]}-gqa{c[2] // c[3]}-{str(c[4])[6:]}"
)
def test_rotary_matches_reference(case, device, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_norm_rope import rotary_embedding

    head_dim, rotary_dim, num_heads, num_kv_heads, dtype, pos_dtype = case
    num_tokens = 6
    gen = torch.Generator().manual_seed(head_dim + rotary_dim + num_heads)
    # Query and key as strided views of one fused projection, the way a model produces them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 50, (num_tokens,), generator=gen).to(pos_dtype).to(device)
    cos_sin = _cos_sin_cache(rotary_dim, 50).to(device)
    expected_q, expected_k = reference.rotary_embedding(positions, query, key, cos_sin)
    got_q, got_k = rotary_embedding(positions, query, key, cos_sin)
    assert_close(got_q, expected_q)
    assert_close(got_k, expected_k)
    assert math.isclose(float(got_q.float().norm()), float(query.float().norm()), rel_tol=1e-2)


def test_rotary_rejects_odd_rotary_dim(device) -> None:
    from inflight.kernels.triton_norm_rope import rotary_embedding

    q = torch.randn(2, 2, 8, device=device)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(
            torch.zeros(2, dtype=torch.int64, device=device), q, q, torch.randn(4, 3, device=device)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (33, 4480)])
def test_silu_and_mul_matches_reference(device, assert_close, poison_allocations, dtype, shape) -> None:
    from inflight.kernels import reference
    from inflight.kernels.triton_activation import silu_and_mul

    num_tokens, d = shape
    gate_up = (3 * torch.randn(num_tokens, 2 * d)).to(dtype).to(device)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    strided = torch.randn(num_tokens, 2 * d + 8).to(dtype).to(device)[:, : 2 * d]  # a row stride != 2d
    assert_close(silu_and_mul(strided), reference.silu_and_mul(strided))


def test_silu_and_mul_rejects_odd_widths(device) -> None:
    from inflight.kernels.triton_activation import silu_and_mul

    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 5, device=device))
