"""Rejection sampling on the device (spec_decode/rejection.py) against the draft-by-draft host
loop: the same tokens and the same draws from each request's generator, case by case."""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.spec_decode.rejection import draw_chunk, draw_chunk_host, draw_chunks, exponential_race

VOCAB = 50


def _case(seed: int) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]:
    """A random case: ``k`` in 0..4, sharp or flat target rows, drafts the target likes or not,
    deterministic or drawn drafts (a draft model that sometimes agrees with the target exactly)."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(0, 5, (1,), generator=g))
    sharpness = float(torch.rand(1, generator=g)) * 6
    probs = torch.softmax(torch.randn(k + 1, VOCAB, generator=g) * sharpness, dim=-1)
    liked = probs[:k].argmax(dim=-1).tolist()
    drafts = tuple(t if float(torch.rand(1, generator=g)) < 0.6 else int(torch.randint(0, VOCAB, (1,), generator=g))
                   for t in liked)  # fmt: skip
    kind = seed % 3
    if kind == 0 or k == 0:
        return probs, drafts, None
    if kind == 1:
        return probs, drafts, probs[:k].clone()  # p == q: nothing can be rejected
    q = torch.softmax(torch.randn(k, VOCAB, generator=g) * sharpness, dim=-1)
    return probs, drafts, q


@pytest.mark.parametrize("seed", range(300))
def test_a_chunk_draws_what_the_host_loop_draws(seed: int) -> None:
    probs, drafts, q = _case(seed)
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    kept, token = draw_chunk(probs, torch.tensor(drafts, dtype=torch.int64), q, ours).tolist()
    assert [*drafts[:kept], token] == draw_chunk_host(probs, drafts, q, theirs)
    assert torch.equal(ours.get_state(), theirs.get_state())  # the same draws, no more, no fewer


def test_a_steps_chunks_are_drawn_in_order_each_with_its_own_generator() -> None:
    cases = [_case(seed) for seed in range(40)]
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(len(cases))]
    refs = [torch.Generator().manual_seed(1000 + i) for i in range(len(cases))]
    got = draw_chunks([p for p, _, _ in cases], [d for _, d, _ in cases], [q for _, _, q in cases], gens,
                      on_device=True)
    assert got == [draw_chunk_host(p, d, q, g) for (p, d, q), g in zip(cases, refs, strict=True)]
    assert any(len(t) <= len(d) for t, (_, d, _) in zip(got, cases, strict=True))  # some drafts were rejected
    assert any(len(t) == len(d) + 1 and d for t, (_, d, _) in zip(got, cases, strict=True))  # some all kept
    assert draw_chunks([], [], [], []) == []


@pytest.mark.parametrize("seed", range(20))
def test_a_draft_whose_residual_is_empty_is_kept(seed: int) -> None:
    """p <= q everywhere (a target row that lost mass to rounding): max(0, p - q) is all zero,
    so a draft the ratio test would reject is kept, as the host loop keeps it."""
    q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)), dim=-1)
    probs = torch.cat([q[:1] * 0.01, torch.softmax(torch.zeros(1, VOCAB), dim=-1)])  # row 0: p = q / 100
    drafts = (int(q[0].argmax()),)
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    got = draw_chunk(probs, torch.tensor(drafts), q[:1], ours).tolist()
    assert got[0] == 1 and [drafts[0], got[1]] == draw_chunk_host(probs, drafts, q[:1], theirs)


@pytest.mark.gpu
def test_on_cuda_a_steps_draws_sync_once() -> None:
    """Every chunk drawn without a device-to-host sync; the one read is the results'."""
    dev = torch.device("cuda")
    cases = [_case(seed) for seed in range(12)]
    probs = [p.to(dev) for p, _, _ in cases]
    qs = [None if q is None else q.to(dev) for _, _, q in cases]
    drafts = [d for _, d, _ in cases]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=dev)
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d))
    gens = [torch.Generator(dev).manual_seed(i) for i in range(len(cases))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = [draw_chunk(p, flat[starts[i] : starts[i + 1]], q, g)
                 for i, (p, q, g) in enumerate(zip(probs, qs, gens, strict=True))]  # fmt: skip
        stacked = torch.stack(drawn)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    refs = [torch.Generator(dev).manual_seed(i) for i in range(len(cases))]
    expected = [draw_chunk_host(p, d, q, g) for p, d, q, g in zip(probs, drafts, qs, refs, strict=True)]
    assert [[*d[:kept], token] for d, (kept, token) in zip(drafts, stacked.tolist(), strict=True)] == expected


@pytest.mark.parametrize("seed", range(50))
def test_the_exponential_race_is_multinomials_draw(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dist = torch.softmax(torch.randn(VOCAB, generator=g) * float(torch.rand(1, generator=g)) * 8, dim=-1)
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    assert exponential_race(dist, ours).tolist() == torch.multinomial(dist, 1, generator=theirs).tolist()
    assert torch.equal(ours.get_state(), theirs.get_state())
