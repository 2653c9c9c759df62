"""Gated DeltaNet kernels (Qwen3-Next's linear attention): the torch references against a naive
per-token loop and against transformers' own functions, chunked continuation equal to one pass, and
the Triton kernels (CUDA, else Triton's interpreter) against the references on a mixed packed batch
(decode rows and prompt chunks, new sequences and continued ones, slots out of order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import gated_delta

HK, HV, DK, DV, TAPS = 2, 4, 32, 24, 4


def _seq_inputs(length: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HK, DK, generator=gen).to(dtype)
    k = torch.randn(length, HK, DK, generator=gen).to(dtype)
    v = torch.randn(length, HV, DV, generator=gen).to(dtype)
    g = -torch.rand(length, HV, generator=gen) * 0.5  # log decays
    beta = torch.rand(length, HV, generator=gen).to(dtype)
    return q, k, v, g, beta


def _naive(q, k, v, g, beta, s):
    """Token by token in float32: the rule as written (``s``: [HV, DK, DV])."""
    group = HV // HK
    q = gated_delta.l2norm(q.float()).repeat_interleave(group, dim=1) * DK**-0.5
    k = gated_delta.l2norm(k.float()).repeat_interleave(group, dim=1)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t].float() - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t].float()[:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def _run_rule(fn, q, k, v, g, beta, state, bounds, slots, has_initial):
    return fn(q, k, v, g, beta, state, torch.tensor(bounds, dtype=torch.int32, device=q.device),
              torch.tensor(slots, dtype=torch.int64, device=q.device),
              torch.tensor(has_initial, dtype=torch.bool, device=q.device))  # fmt: skip


@pytest.mark.parametrize("length", [1, 5, 64, 70, 130])
@pytest.mark.parametrize("initial", [False, True])
def test_reference_rule_matches_a_token_loop(length: int, initial: bool) -> None:
    q, k, v, g, beta = _seq_inputs(length, length)
    state = torch.randn(3, HV, DK, DV) * 0.3
    start = state[2].clone() if initial else torch.zeros(HV, DK, DV)
    want_out, want_state = _naive(q, k, v, g, beta, start)
    out = _run_rule(gated_delta.gated_delta_rule, q, k, v, g, beta, state, [0, length], [2], [initial])
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state[2], want_state, atol=2e-5, rtol=2e-5)


def test_reference_rule_matches_transformers() -> None:
    """transformers' chunked (prefill) and recurrent (decode) torch functions give what ours does."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _seq_inputs(90, 3)
    init = torch.randn(1, HV, DK, DV) * 0.3
    want, want_state = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                       initial_state=init, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    state = init.clone()
    out = _run_rule(gated_delta.gated_delta_rule, q, k, v, g, beta, state, [0, 90], [0], [True])
    torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-6, rtol=1e-5)
    step, step_state = hf.torch_recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], g[None, :1],
                                                           beta[None, :1], initial_state=init, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)  # fmt: skip
    state = init.clone()
    out = _run_rule(gated_delta.gated_delta_rule, q[:1], k[:1], v[:1], g[:1], beta[:1], state, [0, 1], [0], [True])
    torch.testing.assert_close(out, step[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, step_state, atol=1e-6, rtol=1e-5)


def _conv_inputs(length: int, channels: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(length, channels, generator=gen), torch.randn(channels, TAPS, generator=gen) * 0.5


def test_reference_conv_matches_transformers_and_continues_across_chunks() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x, w = _conv_inputs(23)
    want = hf.causal_conv1d_fn(x.t()[None], w, activation="silu")[0].t()
    state = torch.randn(2, 40, TAPS - 1)  # garbage in a reused slot: a new sequence must not read it
    whole = gated_delta.causal_conv1d(x, w, state, torch.tensor([0, 23], dtype=torch.int32),
                                      torch.tensor([1]), torch.tensor([False]))  # fmt: skip
    torch.testing.assert_close(whole, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state[1], x[-(TAPS - 1) :].t())
    # the same sequence as chunks of 2, 1 and 20 rows, each continuing from the slot
    state = torch.randn(2, 40, TAPS - 1)
    parts, begin = [], 0
    for n, initial in ((2, False), (1, True), (20, True)):
        parts.append(gated_delta.causal_conv1d(x[begin : begin + n], w, state, torch.tensor([0, n], dtype=torch.int32),
                                               torch.tensor([0]), torch.tensor([initial])))  # fmt: skip
        begin += n
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-6, rtol=1e-6)


def _mixed_batch(dtype: torch.dtype, device: torch.device):
    """3 decode rows (slots 4, 0, 2; the middle one new), then prompt chunks of 9 (new, slot 1),
    70 (continued, slot 3) and 1 (continued, slot 5)."""
    lengths, slots, initial = [1, 1, 1, 9, 70, 1], [4, 0, 2, 1, 3, 5], [True, False, True, False, True, True]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v, g, beta = _seq_inputs(bounds[-1], 11, dtype)
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(6, HV, DK, DV, generator=gen) * 0.3
    x, w = _conv_inputs(bounds[-1], seed=2)
    conv_state = torch.randn(6, 40, TAPS - 1, generator=gen)
    move = lambda t: t.to(device)  # noqa: E731
    return ([move(t) for t in (q, k, v, g, beta)], move(state), [move(x.to(dtype)), move(w)], move(conv_state.to(dtype)),
            bounds, slots, initial)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_references(device: torch.device, dtype: torch.dtype) -> None:
    from inflight.kernels import triton_gated_delta

    (q, k, v, g, beta), state, (x, w), conv_state, bounds, slots, initial = _mixed_batch(dtype, device)
    ref_state, ref_conv = state.cpu().clone(), conv_state.cpu().clone()
    want = _run_rule(gated_delta.gated_delta_rule, q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), ref_state, bounds,
                     slots, initial)  # fmt: skip
    got = _run_rule(triton_gated_delta.gated_delta_rule, q, k, v, g, beta, state, bounds, slots, initial)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    torch.testing.assert_close(state.cpu(), ref_state, atol=1e-4, rtol=1e-4)
    args = (torch.tensor(bounds, dtype=torch.int32), torch.tensor(slots), torch.tensor(initial))
    want_conv = gated_delta.causal_conv1d(x.cpu(), w.cpu(), ref_conv, *args)
    got_conv = triton_gated_delta.causal_conv1d(x, w, conv_state, *(a.to(device) for a in args))
    torch.testing.assert_close(got_conv.cpu().float(), want_conv.float(), **tol)
    torch.testing.assert_close(conv_state.cpu(), ref_conv)


def test_a_new_sequence_ignores_its_slot() -> None:
    """has_initial False: the slot's old contents weigh nothing (slots are never cleared)."""
    q, k, v, g, beta = _seq_inputs(6, 9)
    a, b = torch.randn(1, HV, DK, DV), torch.zeros(1, HV, DK, DV)
    out_a = _run_rule(gated_delta.gated_delta_rule, q, k, v, g, beta, a, [0, 6], [0], [False])
    out_b = _run_rule(gated_delta.gated_delta_rule, q, k, v, g, beta, b, [0, 6], [0], [False])
    assert torch.equal(out_a, out_b) and torch.equal(a, b)
    assert not torch.equal(F.pad(out_a, (0, 0)), torch.zeros_like(out_a))


def test_native_decode_step_matches_the_reference() -> None:
    """The C one-token step (decode rows, new and continued, slots out of order) and the split it
    makes of a mixed batch (C decode rows, reference prompt chunks) equal the torch reference."""
    from inflight.kernels import cpu_gated_delta

    if cpu_gated_delta.load_library()[0] is None:
        pytest.skip(f"no C build: {cpu_gated_delta.load_library()[1]}")
    (q, k, v, g, beta), state, _, _, bounds, slots, initial = _mixed_batch(torch.float32, torch.device("cpu"))
    ref_state = state.clone()
    want = _run_rule(gated_delta.gated_delta_rule, q, k, v, g, beta, ref_state, bounds, slots, initial)
    got = _run_rule(cpu_gated_delta.gated_delta_rule, q, k, v, g, beta, state, bounds, slots, initial)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-6, rtol=2e-5)
    # decode rows alone, with garbage in a new row's slot
    state[0] = float("nan")
    ref_state = state.clone()
    args = ([0, 1, 2, 3], [4, 0, 2], [True, False, True])
    want = _run_rule(gated_delta.gated_delta_rule, q[:3], k[:3], v[:3], g[:3], beta[:3], ref_state, *args)
    got = _run_rule(cpu_gated_delta.gated_delta_rule, q[:3], k[:3], v[:3], g[:3], beta[:3], state, *args)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-6, rtol=2e-5, equal_nan=True)
