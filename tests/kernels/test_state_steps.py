"""A speculating step's state layers, position by position (model/gated_delta_layer.py's
``run_state_op``): on a packed batch of a plain decode row, two speculating chunks (4 and 2 tokens)
and a continued prompt chunk, each kernel bundle's conv and recurrence (the torch references, the
native C decode steps, Triton's kernels: CUDA, else the interpreter) give every row the output of
running its sequence token by token, leave each slot with the state after its last position, and
keep each speculating chunk's state after its earlier positions in its scratch slots (what the
runner copies back after verification, worker/hybrid_cache.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from inflight.runtime.model.batch import StateSteps
from inflight.runtime.model.gated_delta_layer import StateRows, position_steps, run_state_op

# packed rows: A (slot 2, one token), B (slot 0, 4 tokens), C (slot 3, 2 tokens), then D (slot 1, 9 tokens)
SEQS = [("A", 2, 0, 1), ("B", 0, 1, 4), ("C", 3, 5, 2), ("D", 1, 7, 9)]  # name, slot, first row, length
NUM_SLOTS, FIRST_SCRATCH, NUM_TOKENS, ND = 12, 6, 16, 7
SCRATCH = {("B", 0): 6, ("B", 1): 7, ("B", 2): 8, ("C", 0): 9}  # after position j: 6 + row * 3 + j


def _rows(device: torch.device) -> StateRows:
    plan = StateSteps(  # the bounds stay on the host
        rows=torch.tensor([0, 1, 5, 2, 6, 3, 4], device=device),
        slots=torch.tensor([2, 0, 3, 0, 3, 0, 0], device=device),
        has_initial=torch.ones(7, dtype=torch.bool, device=device),
        keep_from=torch.tensor([0, 3, 0, 0], device=device),
        keep_to=torch.tensor([6, 9, 7, 8], device=device), row_bounds=torch.tensor([0, 3, 5, 6, 7]),
        keep_bounds=torch.tensor([0, 2, 3, 4, 4]),
    )  # fmt: skip
    starts = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 16], dtype=torch.int32, device=device)
    slots = torch.tensor([2, 0, 0, 0, 0, 3, 3, 1], device=device)
    return StateRows(starts, slots, torch.ones(8, dtype=torch.bool, device=device), ND, position_steps(plan))


def _token_by_token(op: Callable[..., torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Each sequence alone, one token a call (D as one chunk): outputs, and B's and C's kept states."""
    outs: dict[int, torch.Tensor] = {}
    kept: dict[tuple[str, int], torch.Tensor] = {}
    one = torch.tensor([0, 1], dtype=torch.int32, device=state.device)
    yes = torch.tensor([True], device=state.device)
    for name, slot, first, length in SEQS:
        slots = torch.tensor([slot], device=state.device)
        if name == "D":
            outs[first] = op(slice(first, first + length), torch.tensor([0, length], dtype=torch.int32,
                                                                         device=state.device), slots, yes)  # fmt: skip
            continue
        for j in range(length):
            outs[first + j] = op(slice(first + j, first + j + 1), one, slots, yes)
            kept[(name, j)] = state[slot].clone()
    return torch.cat([outs[r] for r in sorted(outs)]), kept


def _families(device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(3)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    n = NUM_TOKENS
    q, k, v = r(n, 2, 16).to(dtype), r(n, 2, 16).to(dtype), r(n, 4, 8).to(dtype)
    g, beta = -r(n, 4).abs() * 0.3, torch.rand(n, 4, generator=gen).to(device).to(dtype)
    x, dt = r(n, 4, 8).to(dtype), (r(n, 4).abs() * 0.2 + 0.01)
    a, b, c, d = -r(4).abs() - 0.1, r(n, 2, 6).to(dtype), r(n, 2, 6).to(dtype), r(4)
    conv_x, conv_w, conv_b = r(n, 24).to(dtype), r(24, 4, scale=0.5), r(24, scale=0.1)
    return {
        "rule": (lambda fn, st: lambda sel, s, sl, i: fn(q[sel], k[sel], v[sel], g[sel], beta[sel], st, s, sl, i),
                 r(NUM_SLOTS, 4, 16, 8, scale=0.3)),
        "ssd": (lambda fn, st: lambda sel, s, sl, i: fn(x[sel], dt[sel], a, b[sel], c[sel], d, st, s, sl, i),
                r(NUM_SLOTS, 4, 8, 6, scale=0.3)),
        "conv": (lambda fn, st: lambda sel, s, sl, i: fn(conv_x[sel], conv_w, st, s, sl, i),
                 r(NUM_SLOTS, 24, 3).to(dtype)),
        "conv_bias": (lambda fn, st: lambda sel, s, sl, i: fn(conv_x[sel], conv_w, conv_b, st, s, sl, i),
                      r(NUM_SLOTS, 24, 3).to(dtype)),
    }  # fmt: skip


def _kernels(bundle: str) -> dict[str, Callable[..., torch.Tensor]]:
    from inflight.kernels import gated_delta, mamba2_reference

    found = {"rule": gated_delta.gated_delta_rule, "ssd": mamba2_reference.ssd_scan,
             "conv": gated_delta.causal_conv1d, "conv_bias": mamba2_reference.causal_conv1d}  # fmt: skip
    if bundle == "native":
        from inflight.kernels import cpu_gated_delta, cpu_mamba2

        if cpu_gated_delta.load_library()[0] is None or cpu_mamba2.load_library()[0] is None:
            pytest.skip("no C build")
        found.update(rule=cpu_gated_delta.gated_delta_rule, ssd=cpu_mamba2.ssd_scan)
    if bundle == "triton":
        pytest.importorskip("triton")
        from inflight.kernels import triton_causal_conv, triton_gated_delta, triton_mamba2

        found = {"rule": triton_gated_delta.gated_delta_rule, "ssd": triton_mamba2.ssd_scan,
                 "conv": triton_gated_delta.causal_conv1d, "conv_bias": triton_causal_conv.causal_conv1d}  # fmt: skip
    return found


@pytest.mark.parametrize("op", ["rule", "ssd", "conv", "conv_bias"])
@pytest.mark.parametrize("bundle", ["reference", "native", "triton"])
def test_position_by_position_keeps_every_position_state(bundle: str, op: str) -> None:
    device = torch.device("cuda" if bundle == "triton" and torch.cuda.is_available() else "cpu")
    fn = _kernels(bundle)[op]
    make, state = _families(device, torch.float32)[op]
    want_state = state.clone()
    want, kept = _token_by_token(make(fn, want_state), want_state)
    got = run_state_op(make(fn, state), _rows(device), state, NUM_TOKENS)
    tol = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(state[:FIRST_SCRATCH], want_state[:FIRST_SCRATCH], **tol)  # every slot's last state
    for (name, j), scratch in SCRATCH.items():
        torch.testing.assert_close(state[scratch], kept[(name, j)], **tol)
    assert not torch.equal(state[SCRATCH[("B", 0)]], state[SCRATCH[("B", 2)]])  # the positions differ
