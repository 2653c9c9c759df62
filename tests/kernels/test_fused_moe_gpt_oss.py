"""The fused mixture-of-experts MLP with gpt-oss's options: per-expert biases on both matmuls
and the clamped SwiGLU. The torch reference against transformers' own ``GptOssExperts`` (its
interleaved, transposed layout converted to ours), and the Triton kernel (CUDA, else Triton's
interpreter) against the reference; without the options both stay as they were.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference
from inflight.kernels.reference import ClampedSwiglu

F32, BF16 = torch.float32, torch.bfloat16
ACT = ClampedSwiglu(alpha=1.702, limit=0.9)  # a limit the random activations cross


def _inputs(num_tokens: int, hidden: int, width: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=gen) * hidden**-0.5 * 2
    w2 = torch.randn(num_experts, hidden, width, generator=gen) * width**-0.5
    b13 = torch.randn(num_experts, 2 * width, generator=gen) * 0.5
    b2 = torch.randn(num_experts, hidden, generator=gen) * 0.5
    top, ids = torch.topk(torch.randn(num_tokens, num_experts, generator=gen), top_k, dim=-1)
    return x, w13, w2, b13, b2, torch.softmax(top, dim=-1), ids


def test_reference_matches_transformers_gpt_oss_experts() -> None:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    num_tokens, hidden, width, num_experts, top_k = 23, 32, 16, 8, 2
    x, w13, w2, b13, b2, weights, ids = _inputs(num_tokens, hidden, width, num_experts, top_k, 0)
    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=width, num_local_experts=num_experts,
                                       swiglu_limit=ACT.limit, swiglu_alpha=ACT.alpha)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    with torch.no_grad():  # ours: gate rows then up rows; theirs: [E, hidden, 2I], gate/up interleaved
        gate_up = torch.empty(num_experts, hidden, 2 * width)
        gate_up[..., 0::2], gate_up[..., 1::2] = w13[:, :width].transpose(1, 2), w13[:, width:].transpose(1, 2)
        experts.gate_up_proj.copy_(gate_up)
        experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2] = b13[:, :width], b13[:, width:]
        experts.down_proj.copy_(w2.transpose(1, 2))
        experts.down_proj_bias.copy_(b2)
        want = experts(x, ids, weights)
    got = reference.fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=ACT)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unclamped = reference.fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2,
                                    activation=ClampedSwiglu(ACT.alpha, 1e9))  # fmt: skip
    assert not torch.allclose(unclamped, want)  # the clamp matters in this case


# (num_tokens, hidden, intermediate, num_experts, top_k, dtype)
CASES = [(1, 32, 16, 8, 2, F32), (37, 64, 32, 16, 4, F32), (20, 32, 16, 8, 2, BF16), (0, 32, 16, 8, 2, F32)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-e{c[3]}-k{c[4]}-{c[5]}")
def test_triton_matches_reference(case, device, assert_close) -> None:
    from inflight.kernels.triton_moe import fused_moe

    num_tokens, hidden, width, num_experts, top_k, dtype = case
    x, w13, w2, b13, b2, weights, ids = _inputs(num_tokens, hidden, width, num_experts, top_k, num_tokens)
    x, w13, w2, b13, b2 = (t.to(dtype).to(device) for t in (x, w13, w2, b13, b2))
    weights, ids = weights.to(device), ids.to(device)
    options = {"w13_bias": b13, "w2_bias": b2, "activation": ACT}
    expected = reference.fused_moe(x, w13, w2, weights, ids, **options)
    assert_close(fused_moe(x, w13, w2, weights, ids, **options), expected)
    if num_tokens:  # without the options: the plain SwiGLU, no biases, as before
        assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))


def test_triton_refuses_a_bias_of_the_wrong_shape(device) -> None:
    from inflight.kernels.triton_moe import fused_moe

    x, w13, w2, b13, b2, weights, ids = _inputs(4, 32, 16, 8, 2, 1)
    with pytest.raises(ValueError, match="w2_bias must be"):
        fused_moe(x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device),
                  w13_bias=b13.to(device), w2_bias=b2[:, :8].to(device))  # fmt: skip
