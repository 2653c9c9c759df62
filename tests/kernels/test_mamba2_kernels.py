"""Mamba-2 kernels (Granite 4's hybrid layers): the torch references against a naive per-token loop
and against transformers' own torch functions (chunked scan, one-step update, conv), chunked
continuation equal to one pass, a new sequence ignoring its slot, the C decode step and the Triton
kernels (CUDA, else Triton's interpreter) against the references on a mixed packed batch (decode
rows and prompt chunks, new sequences and continued ones, slots out of order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import mamba2_reference as ref

H, P, G, N, TAPS, CH = 4, 8, 2, 16, 4, 40


def _seq_inputs(length: int, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, H, P, generator=gen).to(dtype)
    dt = F.softplus(torch.randn(length, H, generator=gen))
    a = -torch.rand(H, generator=gen) * 2.0
    b = torch.randn(length, G, N, generator=gen).to(dtype)
    c = torch.randn(length, G, N, generator=gen).to(dtype)
    d = torch.rand(H, generator=gen) + 0.5
    return x, dt, a, b, c, d


def _naive(x, dt, a, b, c, d, s):
    """Token by token in float32, as written (``s``: [H, P, N])."""
    b, c = (t.float().repeat_interleave(H // G, dim=1) for t in (b, c))
    out = []
    for t in range(x.shape[0]):
        s = s * torch.exp(dt[t] * a)[:, None, None] + dt[t][:, None, None] * x[t].float()[:, :, None] * b[t][:, None]
        out.append(torch.einsum("hpn,hn->hp", s, c[t]) + d[:, None] * x[t].float())
    return torch.stack(out), s


def _scan(fn, inputs, state, bounds, slots, initial):
    device = state.device
    return fn(*inputs, state, torch.tensor(bounds, dtype=torch.int32, device=device),
              torch.tensor(slots, dtype=torch.int64, device=device),
              torch.tensor(initial, dtype=torch.bool, device=device))  # fmt: skip


@pytest.mark.parametrize("length", [1, 5, 64, 70, 130])
@pytest.mark.parametrize("initial", [False, True])
def test_reference_scan_matches_a_token_loop(length: int, initial: bool) -> None:
    inputs = _seq_inputs(length, length)
    state = torch.randn(3, H, P, N) * 0.3
    start = state[2].clone() if initial else torch.zeros(H, P, N)
    want_out, want_state = _naive(*inputs, start)
    out = _scan(ref.ssd_scan, inputs, state, [0, length], [2], [initial])
    torch.testing.assert_close(out, want_out, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(state[2], want_state, atol=5e-5, rtol=5e-5)


def test_reference_matches_transformers() -> None:
    """transformers' chunked scan (prefill, 16-token chunks), one-step update (decode) and causal
    conv (its torch fallbacks) give what ours do."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    x, dt, a, b, c, d = _seq_inputs(45, 3)
    init = torch.randn(1, H, P, N) * 0.3
    raw_dt = torch.log(torch.expm1(dt))  # transformers takes dt before softplus
    want, want_state = hf.mamba2_chunk_scan(x[None], raw_dt[None], a, b[None], c[None], 16, D=d,
                                            initial_states=init, dt_softplus=True, return_final_states=True)
    state = init.clone()
    out = _scan(ref.ssd_scan, (x, dt, a, b, c, d), state, [0, 45], [0], [True])
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=2e-5)
    hf_state = init.clone()
    step = hf.mamba2_selective_state_update(hf_state, x[:1], raw_dt[:1, :, None].expand(1, H, P),
                                            a[:, None, None].expand(H, P, N), b[:1], c[:1],
                                            d[:, None].expand(H, P), dt_softplus=True)  # fmt: skip
    state = init.clone()
    out = _scan(ref.ssd_scan, tuple(t[:1] if t.shape[0] == 45 else t for t in (x, dt, a, b, c, d)), state,
                [0, 1], [0], [True])  # fmt: skip
    torch.testing.assert_close(out, step, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, hf_state, atol=1e-6, rtol=1e-5)
    xs, w, bias = _conv_inputs(23)
    want_conv = hf.causal_conv1d_fn(xs.t()[None], w, bias, activation="silu")[0].t()
    conv_state = torch.randn(2, CH, TAPS - 1)  # garbage in a reused slot: a new sequence must not read it
    got = ref.causal_conv1d(xs, w, bias, conv_state, torch.tensor([0, 23], dtype=torch.int32), torch.tensor([1]),
                            torch.tensor([False]))  # fmt: skip
    torch.testing.assert_close(got, want_conv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(conv_state[1], xs[-(TAPS - 1) :].t())


def test_chunks_continue_from_the_slot() -> None:
    """One sequence as chunks of 2, 1 and 40 rows, each continuing from its slot, equals one pass."""
    inputs = _seq_inputs(43, 4)
    xs, w, bias = _conv_inputs(43)
    whole_state, whole_conv = torch.zeros(1, H, P, N), torch.zeros(1, CH, TAPS - 1)
    want = _scan(ref.ssd_scan, inputs, whole_state, [0, 43], [0], [False])
    want_conv = ref.causal_conv1d(xs, w, bias, whole_conv, torch.tensor([0, 43], dtype=torch.int32),
                                  torch.tensor([0]), torch.tensor([False]))  # fmt: skip
    state, conv = torch.randn(1, H, P, N), torch.randn(1, CH, TAPS - 1)
    outs, convs, begin = [], [], 0
    for n, initial in ((2, False), (1, True), (40, True)):
        part = tuple(t[begin : begin + n] if t.dim() > 1 else t for t in inputs)
        outs.append(_scan(ref.ssd_scan, part, state, [0, n], [0], [initial]))
        convs.append(ref.causal_conv1d(xs[begin : begin + n], w, bias, conv, torch.tensor([0, n], dtype=torch.int32),
                                       torch.tensor([0]), torch.tensor([initial])))  # fmt: skip
        begin += n
    torch.testing.assert_close(torch.cat(outs), want, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(state, whole_state, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(torch.cat(convs), want_conv)
    torch.testing.assert_close(conv, whole_conv)


def test_a_new_sequence_ignores_its_slot() -> None:
    inputs = _seq_inputs(6, 9)
    a, b = torch.randn(1, H, P, N), torch.zeros(1, H, P, N)
    out_a = _scan(ref.ssd_scan, inputs, a, [0, 6], [0], [False])
    out_b = _scan(ref.ssd_scan, inputs, b, [0, 6], [0], [False])
    assert torch.equal(out_a, out_b) and torch.equal(a, b)


def _conv_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(length, CH, generator=gen), torch.randn(CH, TAPS, generator=gen) * 0.5,
            torch.randn(CH, generator=gen) * 0.5)  # fmt: skip


def _mixed_batch(dtype: torch.dtype, device: torch.device):
    """3 decode rows (slots 4, 0, 2; the middle one new), then prompt chunks of 9 (new, slot 1),
    70 (continued, slot 3) and 1 (continued, slot 5)."""
    lengths, slots, initial = [1, 1, 1, 9, 70, 1], [4, 0, 2, 1, 3, 5], [True, False, True, False, True, True]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    inputs = _seq_inputs(bounds[-1], 11, dtype)
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(6, H, P, N, generator=gen) * 0.3
    xs, w, bias = _conv_inputs(bounds[-1], seed=2)
    conv_state = torch.randn(6, CH, TAPS - 1, generator=gen)
    return ([t.to(device) for t in inputs], state.to(device), [xs.to(dtype).to(device), w.to(device), bias.to(device)],
            conv_state.to(dtype).to(device), bounds, slots, initial)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_references(device: torch.device, dtype: torch.dtype) -> None:
    from inflight.kernels import triton_mamba2

    inputs, state, (xs, w, bias), conv_state, bounds, slots, initial = _mixed_batch(dtype, device)
    ref_state, ref_conv = state.cpu().clone(), conv_state.cpu().clone()
    want = _scan(ref.ssd_scan, [t.cpu() for t in inputs], ref_state, bounds, slots, initial)
    got = _scan(triton_mamba2.ssd_scan, inputs, state, bounds, slots, initial)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    torch.testing.assert_close(state.cpu(), ref_state, atol=1e-4, rtol=1e-4)
    args = (torch.tensor(bounds, dtype=torch.int32), torch.tensor(slots), torch.tensor(initial))
    want_conv = ref.causal_conv1d(xs.cpu(), w.cpu(), bias.cpu(), ref_conv, *args)
    got_conv = triton_mamba2.causal_conv1d(xs, w, bias, conv_state, *(a.to(device) for a in args))
    torch.testing.assert_close(got_conv.cpu().float(), want_conv.float(), **tol)
    torch.testing.assert_close(conv_state.cpu(), ref_conv)


def test_native_decode_step_matches_the_reference() -> None:
    """The C one-step update (decode rows, new and continued, slots out of order) and the split it
    makes of a mixed batch (C decode rows, reference prompt chunks) equal the torch reference."""
    from inflight.kernels import cpu_mamba2

    if cpu_mamba2.load_library()[0] is None:
        pytest.skip(f"no C build: {cpu_mamba2.load_library()[1]}")
    inputs, state, _, _, bounds, slots, initial = _mixed_batch(torch.float32, torch.device("cpu"))
    ref_state = state.clone()
    want = _scan(ref.ssd_scan, inputs, ref_state, bounds, slots, initial)
    got = _scan(cpu_mamba2.ssd_scan, inputs, state, bounds, slots, initial)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-6, rtol=2e-5)
    state[0] = float("nan")  # decode rows alone, with garbage in a new row's slot
    ref_state = state.clone()
    rows = tuple(t[:3] if t.dim() > 1 else t for t in inputs)
    want = _scan(ref.ssd_scan, rows, ref_state, [0, 1, 2, 3], [4, 0, 2], [True, False, True])
    got = cpu_mamba2.decode_step(*rows, state, torch.tensor([4, 0, 2]), torch.tensor([True, False, True]))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-6, rtol=2e-5, equal_nan=True)
