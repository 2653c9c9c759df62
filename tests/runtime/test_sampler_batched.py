"""The batched sampler (worker/batched_sampling.py) against the per-row reference it replaced.

The reference below is the sampler as it was, row by row (one generator draw, one top-k and one
tensor per row): greedy rows and seeded rows must give exactly its tokens, unseeded rows its
distribution (a chi-square test over many draws, with fixed seeds so it cannot flake), and a
step must make at most one host sync whatever the number of rows.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.batched_sampling import apply_filters, draw, filter_tensors, shape_batch
from inflight.runtime.worker.graph_backend import _HOST_SYNCS, no_host_sync
from inflight.runtime.worker.sampler import Sampler, SamplingRow

VOCAB = 48
EOS = 0


# -- the per-row reference (the sampler before batching) -------------------------------------
def ref_shape(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        for t, b in p.logit_bias:
            logits[i, t] += b
        if p.repetition_penalty != 1.0:
            seen = sorted(set(row.prompt_token_ids) | set(row.output_token_ids))
            if seen:
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(list(row.output_token_ids)), minlength=logits.shape[1]).float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
            logits[i, banned] = float("-inf")


def ref_filtered(row_logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, temperature applied and top-k / top-p / min-p masked."""
    x = row_logits / (p.temperature or 1.0)
    vocab = x.shape[0]
    if p.top_k > 0 or p.top_p < 1.0:
        s, order = x.sort(descending=True)
        drop = torch.arange(vocab) >= (p.top_k if p.top_k > 0 else vocab)
        sp = torch.softmax(s, dim=-1)
        drop |= (sp.cumsum(-1) - sp) > p.top_p
        drop[0] = False
        x = torch.empty_like(x).scatter_(0, order, s.masked_fill(drop, float("-inf")))
    if p.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def ref_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    logits = logits.clone()
    ref_shape(logits, rows)
    ids, lps = [], []
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            t = int(logits[i].argmax())
        else:
            probs = torch.softmax(ref_filtered(logits[i], p), dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=row.generator)
            t = int((probs / noise).argmax())
        ids.append(t)
        if p.logprobs is None:
            lps.append(None)
            continue
        logp = torch.log_softmax(logits[i], dim=-1)
        vals, idx = logp.topk(p.logprobs) if p.logprobs else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        lps.append(TokenLogprob(t, float(logp[t]), tuple(zip(idx.tolist(), vals.tolist(), strict=True))))
    return ids, lps


# -- helpers ---------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(params: SamplingParams, out: list[int] | None = None, seed: int | None = None) -> SamplingRow:
    return SamplingRow(params, [3, 4, 5, 3], out or [], _gen(seed) if seed is not None else None, (EOS,))


def _mixed_rows(n: int, greedy: bool) -> list[SamplingRow]:
    """Rows that between them use every feature (cycled up to ``n`` rows)."""
    t = 0.0 if greedy else 0.8
    kinds = [
        SamplingParams(temperature=t),
        SamplingParams(temperature=t, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=t, frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(temperature=t, logit_bias=((7, 5.0), (9, -100.0)), logprobs=0),
        SamplingParams(temperature=t, min_tokens=6, max_tokens=8, stop_token_ids=(11,)),
        SamplingParams(temperature=t, top_k=5, top_p=0.9, min_p=0.05, logprobs=2),
        SamplingParams(temperature=t, top_p=0.7, repetition_penalty=0.8),
    ]
    return [_row(kinds[i % len(kinds)], [5, 5, 9, 12 + i % 7], seed=100 + i if not greedy else None)
            for i in range(n)]  # fmt: skip


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=_gen(seed)) * 3.0


def _clone_rows(rows: list[SamplingRow]) -> list[SamplingRow]:
    """The same rows with fresh generators in the same state."""
    return [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids,
                        None if r.generator is None else _gen(r.generator.initial_seed()), r.eos_token_ids)
            for r in rows]  # fmt: skip


def _assert_logprobs_equal(got: list[TokenLogprob | None], want: list[TokenLogprob | None]) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert g.token_id == w.token_id
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 33])
def test_greedy_tokens_and_logprobs_match_the_reference(n):
    rows = _mixed_rows(n, greedy=True)
    logits = _logits(n, seed=n)
    got = Sampler(torch.device("cpu")).sample(logits.clone(), rows)
    ids, lps = ref_sample(logits, rows)
    assert got.token_ids == ids
    _assert_logprobs_equal(got.logprobs, lps)


def test_min_tokens_ban_and_bias_reach_the_token():
    rows = [_row(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,))),
            _row(SamplingParams(temperature=0.0, logit_bias=((40, 100.0),)))]  # fmt: skip
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = logits[:, 2] = 50.0
    got = Sampler(torch.device("cpu")).sample(logits, rows).token_ids
    assert got[0] not in (EOS, 2) and got[1] == 40


@pytest.mark.parametrize("n", [3, 14])
def test_seeded_rows_draw_exactly_the_reference_tokens(n):
    rows = _mixed_rows(n, greedy=False)
    rows[1] = _row(SamplingParams(temperature=0.0, logprobs=1))  # a greedy row in the mix
    logits = _logits(n, seed=7)
    ref_rows = _clone_rows(rows)
    sampler = Sampler(torch.device("cpu"))
    for step in range(4):  # each row's generator advances step by step, as the reference's
        got = sampler.sample(logits.clone() + step, rows)
        ids, lps = ref_sample(logits + step, ref_rows)
        assert got.token_ids == ids
        _assert_logprobs_equal(got.logprobs, lps)


def test_seeded_row_gets_the_same_tokens_whatever_shares_the_batch():
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    row_logits = _logits(1, seed=3)
    alone_row = _row(target, seed=5)
    sampler = Sampler(torch.device("cpu"))
    alone = [sampler.sample(row_logits.clone(), [alone_row]).token_ids[0] for _ in range(6)]
    others = _mixed_rows(9, greedy=False)
    for r in others[::2]:
        r.generator = None  # unseeded neighbours too
    mine = _row(target, seed=5)
    batch = others[:4] + [mine] + others[4:]
    shared = []
    for _ in range(6):
        logits = torch.cat([_logits(4, seed=11), row_logits, _logits(5, seed=12)])
        shared.append(sampler.sample(logits, batch).token_ids[4])
    assert shared == alone


# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3),
])  # fmt: skip
def test_unseeded_draws_follow_the_reference_distribution(params):
    vocab, draws = 10, 6000
    base = torch.randn(1, vocab, generator=_gen(21)) * 1.5
    row = SamplingRow(params, [1, 2], [2, 3], None, ())
    shaped = base.clone()
    ref_shape(shaped, [row])
    expected = torch.softmax(ref_filtered(shaped[0], params), dim=-1).double()
    torch.manual_seed(1234)  # the default generator the unseeded rows draw from: fixed, never flaky
    ids = Sampler(torch.device("cpu")).sample(base.expand(draws, vocab).clone(), [row] * draws).token_ids
    observed = torch.bincount(torch.tensor(ids), minlength=vocab).double()
    support = expected > 0
    assert observed[~support].sum() == 0  # nothing outside the filtered set is ever drawn
    exp_counts = expected[support] * draws
    chi2 = float(((observed[support] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return
    assert chi2 < _CHI2_999[dof], f"chi2 {chi2:.1f} over {dof} degrees of freedom"
    # and the test can fail: a wrong distribution (plain softmax, no filters) is rejected
    wrong = torch.softmax(shaped[0] / (params.temperature or 1.0), dim=-1).double()
    if not torch.allclose(wrong, expected, atol=1e-3):
        w = wrong * draws
        assert float(((observed - w) ** 2 / w).sum()) > _CHI2_999[vocab - 1]


class _SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values (what would be a device->host sync on CUDA).
    ``.numpy()`` is left out: it exists only for CPU tensors, so code calling it never runs on
    a device (the CPU's numpy argmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _HOST_SYNCS and func is not torch.Tensor.numpy:
            self.count += 1
        elif func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
                self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("greedy", [True, False])
def test_one_host_sync_per_step_whatever_the_number_of_rows(greedy):
    counts = {}
    for n in (1, 8, 64):
        rows = _mixed_rows(n, greedy=greedy)
        logits = _logits(n)
        with _SyncCounter() as counter:
            Sampler(torch.device("cpu")).sample(logits, rows)
        counts[n] = counter.count
    assert max(counts.values()) <= 1 and counts[8] == counts[64] == 1  # (one greedy row: numpy's argmax, none)


def test_shaping_and_drawing_make_no_host_sync():
    rows = _mixed_rows(20, greedy=False)
    logits = _logits(20)
    with no_host_sync():  # raises on .item(), .tolist(), bool(tensor), boolean indexing, ...
        shape_batch(logits, rows)
        apply_filters(logits, filter_tensors(rows, VOCAB, logits.device))
        draw(logits, rows)


def test_the_counter_sees_per_row_syncs():
    """The sync counter is not blind: the per-row reference makes several per row."""
    rows = _mixed_rows(8, greedy=False)
    with _SyncCounter() as counter:
        ref_sample(_logits(8), rows)
    assert counter.count >= 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_syncs_once_and_greedy_matches_the_cpu():
    """On the device itself: CUDA's own sync detector (blocking copies included, which the
    counter above cannot see on the CPU) finds no sync in shaping and drawing, and exactly one
    in a whole step, at 1 row and at 64; greedy tokens equal the CPU's."""
    import warnings

    dev = torch.device("cuda")
    for n in (1, 64):
        rows = _mixed_rows(n, greedy=False)
        for r in rows:
            r.generator = torch.Generator(dev).manual_seed(r.generator.initial_seed()) if r.generator else None
        logits = _logits(n).to(dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            shape_batch(logits, rows)
            draw(logits, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                Sampler(dev).sample(_logits(n).to(dev), rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
    greedy = _mixed_rows(33, greedy=True)
    logits = _logits(33, seed=4)
    got = Sampler(dev).sample(logits.to(dev), greedy)
    want = Sampler(torch.device("cpu")).sample(logits.clone(), greedy)
    assert got.token_ids == want.token_ids
    _assert_logprobs_equal(got.logprobs, want.logprobs)
