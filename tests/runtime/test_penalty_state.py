"""Penalties from per-request state on the device (worker/penalty_state.py) against the same
penalties computed from the rows' token lists (the path a row without state takes).

Requests are run step by step through two samplers fed the same logits: one whose rows carry
their request's :class:`RequestPenalties` (state filled once, then followed on the device from
the sampled ids) and one whose rows carry none. The shaped logits must be bitwise equal and the
tokens identical (greedy and seeded), through the events that make the state catch up or start
over: tokens appended outside the sampler (speculation), a sampled token that was dropped (a
failed step sampled again), deferred rows, requests leaving and new ones reusing their rows, and
the pool compacting its live rows once most have left (or its widest row has).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from inflight.runtime import LLM
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.graph_backend import no_host_sync
from inflight.runtime.worker.penalty_state import RequestPenalties, _halved_to
from inflight.runtime.worker.sampler import Sampler, SamplingRow, SettledMasks

VOCAB = 300  # wide enough for rows to outgrow the pool's first width (64 entries)


@dataclass
class _Req:
    params: SamplingParams
    prompt: list[int]
    seed: int
    outputs: list[int] = field(default_factory=list)
    holder: RequestPenalties = field(default_factory=RequestPenalties)
    gens: tuple[torch.Generator, torch.Generator] | None = None

    def __post_init__(self) -> None:
        if not self.params.greedy:
            self.gens = (torch.Generator().manual_seed(self.seed), torch.Generator().manual_seed(self.seed))

    def row(self, stateful: bool) -> SamplingRow:
        gen = None if self.gens is None else self.gens[0 if stateful else 1]
        return SamplingRow(self.params, self.prompt, list(self.outputs), gen, (0,), None,
                           self.holder if stateful else None)  # fmt: skip


_KINDS = [
    dict(repetition_penalty=1.4),
    dict(frequency_penalty=0.6, presence_penalty=0.4),
    dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    dict(presence_penalty=1.5, top_k=8),
    dict(),  # no penalty: shares the batch, never touches the state
]


def _new(i: int, greedy: bool, kinds: int = len(_KINDS)) -> _Req:
    g = torch.Generator().manual_seed(1000 + i)
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 100, (1,), generator=g)),), generator=g).tolist()
    params = SamplingParams(temperature=0.0 if greedy else 0.9, seed=None if greedy else i, **_KINDS[i % kinds])
    return _Req(params, prompt, seed=i)


def _step(a: Sampler, b: Sampler, reqs: list[_Req], step: int, deferred: frozenset[int] = frozenset()) -> list[int]:
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(step)) * 3.0
    la, lb = logits.clone(), logits.clone()
    settled = SettledMasks((), None, deferred)
    got = a.sample(la, [r.row(True) for r in reqs], settled)
    want = b.sample(lb, [r.row(False) for r in reqs], settled)
    assert torch.equal(la, lb), f"step {step}: shaped logits differ"
    assert got.token_ids == want.token_ids, f"step {step}"
    return got.token_ids


def _run(greedy: bool, kinds: int = len(_KINDS)) -> Sampler:
    """``kinds``: the first kinds of ``_KINDS`` used (4: every row penalized)."""
    a, b = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy, kinds) for i in range(11)]  # more than the pool's first 8 slots
    arrivals = len(reqs)
    for step in range(60):
        deferred = frozenset({1, 4}) if step % 9 == 5 else frozenset()
        tokens = _step(a, b, reqs, step, deferred)
        for j, (req, t) in enumerate(zip(reqs, tokens, strict=True)):
            if j in deferred:
                continue
            if step % 7 == 3 and j == 2:
                continue  # the step's token is dropped (a failed step): sampled again next step
            req.outputs.append(t)
            if step % 5 == 1 and j == 0:
                req.outputs += [(t + 1) % VOCAB, t]  # accepted drafts: appended outside the sampler
        if step % 6 == 4:  # the oldest leaves, a new request takes its row
            reqs[0].holder.release()
            reqs = reqs[1:] + [_new(arrivals, greedy, kinds)]
            arrivals += 1
    for req in reqs:
        req.holder.release()
    return a


def test_penalty_state_matches_the_token_lists_greedy():
    sampler = _run(greedy=True)
    pool = sampler.penalties
    assert pool.capacity == 16 and pool.ids.shape[1] > 64  # grown both ways while in use
    assert pool.num_used == 0  # and every row given back


def test_penalty_state_matches_the_token_lists_seeded():
    _run(greedy=False)


def test_penalty_state_matches_the_token_lists_when_every_row_is_penalized():
    _run(greedy=True, kinds=4)  # the whole batch's logits at once (no row index)


def test_rows_of_a_released_request_fall_back_to_the_token_lists():
    """A request released while its step samples (an abort on the engine thread) is penalized
    from its token lists and never takes a row again."""
    a, b = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    req = _new(0, greedy=True)
    req.outputs = [3, 3, 7]
    _step(a, b, [req], 0)
    used = a.penalties.num_used
    req.holder.release()
    _step(a, b, [req], 1)
    assert req.holder.slot is None and a.penalties.num_used == used - 1


def test_a_steady_step_and_a_first_step_make_no_host_sync():
    sampler = Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy=False) for i in range(6)]
    for _ in range(3):  # the first step fills the rows, the others only follow the sampled ids
        rows = [r.row(True) for r in reqs]
        with no_host_sync():
            pending = sampler.start_sample(torch.randn(6, VOCAB), rows)
        for req, t in zip(reqs, pending.result().token_ids, strict=True):
            req.outputs.append(t)


def test_the_engine_gives_every_row_back_when_its_requests_finish(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, max_num_sequences=4, device="cpu")
    params = [SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=2, frequency_penalty=0.5, presence_penalty=0.3,
                             ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]  # fmt: skip
    outs = llm.generate(["a b a b", "x = x + ", "def f():"], params)
    assert [len(o.token_ids) for o in outs] == [6, 9, 4]
    pool = llm.engine.sampler.penalties
    assert pool.capacity > 0 and pool.num_used == 0


def _follow(a: Sampler, b: Sampler, reqs: list[_Req], steps: range) -> None:
    """Run ``reqs`` through ``steps`` on both samplers (checked equal), keeping their tokens."""
    for step in steps:
        for req, t in zip(reqs, _step(a, b, reqs, step), strict=True):
            req.outputs.append(t)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_pool_shrinks_after_a_burst_and_the_survivors_keep_their_penalties(greedy: bool) -> None:
    """A burst of 40 penalized requests grows the pool to 64 rows; once 37 have left, the next
    step compacts the 3 survivors into 8 rows (renumbered), and their penalties go on equal to
    the token lists' (bitwise, checked at every step by ``_step``), through later arrivals too."""
    a, b = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy, kinds=4) for i in range(40)]
    _follow(a, b, reqs, range(3))
    pool = a.penalties
    assert pool.capacity == 64 and pool.num_used == 40
    survivors = [reqs[5], reqs[22], reqs[39]]
    slots_before = [r.holder.slot for r in survivors]
    for req in reqs:
        if req not in survivors:
            req.holder.release()
    assert pool.capacity == 64  # freed rows are kept until a step prepares
    _follow(a, b, survivors, range(3, 4))
    assert pool.capacity == 8 and pool.num_used == 3 and pool.epoch == 1
    assert [r.holder.slot for r in survivors] == [0, 1, 2] != slots_before
    _follow(a, b, survivors, range(4, 12))
    arrivals = [_new(100 + i, greedy, kinds=4) for i in range(6)]  # 9 rows: the pool grows again
    _follow(a, b, survivors + arrivals, range(12, 20))
    assert pool.capacity == 16 and pool.num_used == 9 and pool.epoch == 1


def test_the_pool_narrows_when_its_widest_row_leaves() -> None:
    """One request penalizing (repetition) every token of a vocabulary-wide prompt widens every
    row; when it leaves, the next step copies the narrow survivors into a narrower pool."""
    a, b = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    wide = _Req(SamplingParams(temperature=0.0, repetition_penalty=1.3), list(range(VOCAB)), seed=0)
    narrow = [_Req(SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2), [1, 2], seed=i)
              for i in range(3)]  # fmt: skip
    _follow(a, b, [wide, *narrow], range(4))
    pool = a.penalties
    assert pool.ids.shape[1] >= VOCAB and pool.capacity == 8  # too few rows to shrink by count
    wide.holder.release()
    _follow(a, b, narrow, range(4, 10))
    assert pool.ids.shape[1] == 64 and pool.capacity == 8 and pool.epoch == 1
    assert max(r.holder.bound for r in narrow) <= 10


def test_a_step_that_compacts_makes_no_host_sync() -> None:
    sampler = Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy=False, kinds=4) for i in range(20)]
    for step in range(3):  # the third step compacts the two survivors
        if step == 2:
            for req in reqs[2:]:
                req.holder.release()
            reqs = reqs[:2]
        rows = [r.row(True) for r in reqs]
        with no_host_sync():
            pending = sampler.start_sample(torch.randn(len(reqs), VOCAB), rows)
        for req, t in zip(reqs, pending.result().token_ids, strict=True):
            req.outputs.append(t)
    assert sampler.penalties.capacity == 8 and sampler.penalties.epoch == 1


def test_rows_prepared_before_a_compaction_are_refused_after_it() -> None:
    """A step's slot numbers hold from its prepare to its record; a compaction in between (which
    the sampler never lets happen) is caught, not written to the wrong rows."""
    pool = Sampler(torch.device("cpu")).penalties
    reqs = [_new(i, greedy=True, kinds=4) for i in range(20)]
    stale = pool.prepare([r.row(True) for r in reqs], range(20))
    for req in reqs[1:]:
        req.holder.release()
    pool.prepare([reqs[0].row(True)], [0])  # compacts
    assert pool.epoch == 1
    with pytest.raises(RuntimeError, match="compacted"):
        pool.record(stale, torch.zeros(20, dtype=torch.int64))


@pytest.mark.parametrize(("used", "size", "floor", "want"), [
    (3, 64, 8, 8),  # a quarter or less: twice what is used, from the floor up
    (16, 64, 8, 32),
    (17, 64, 8, 64),  # more than a quarter: kept
    (0, 8, 8, 8),  # at the floor: kept
    (0, 300, 64, 64),  # an odd width (a row outgrew twice the old one)
    (70, 300, 64, 256),
])  # fmt: skip
def test_shrink_sizes(used: int, size: int, floor: int, want: int) -> None:
    assert _halved_to(used, size, floor) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_state_makes_no_sync_and_greedy_matches_the_cpu():
    """CUDA's own sync detector finds no sync in queuing a step (the fill included), and the
    greedy tokens equal those of the CPU's token-list path."""
    dev = torch.device("cuda")
    cuda, cpu = Sampler(dev), Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy=True) for i in range(12)]
    for step in range(6):
        logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(step)) * 3.0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = cuda.start_sample(logits.to(dev), [r.row(True) for r in reqs])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got = pending.result().token_ids
        assert got == cpu.sample(logits, [r.row(False) for r in reqs]).token_ids, f"step {step}"
        for req, t in zip(reqs, got, strict=True):
            req.outputs.append(t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_compacting_step_makes_no_sync_and_greedy_matches_the_cpu():
    """The compaction (20 rows down to 2, in 8 slots) is queued without a sync on CUDA, and the
    survivors' greedy tokens stay those of the CPU's token-list path."""
    dev = torch.device("cuda")
    cuda, cpu = Sampler(dev), Sampler(torch.device("cpu"))
    reqs = [_new(i, greedy=True, kinds=4) for i in range(20)]
    for step in range(5):
        if step == 3:
            for req in reqs[2:]:
                req.holder.release()
            reqs = reqs[:2]
        logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(step)) * 3.0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = cuda.start_sample(logits.to(dev), [r.row(True) for r in reqs])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got = pending.result().token_ids
        assert got == cpu.sample(logits, [r.row(False) for r in reqs]).token_ids, f"step {step}"
        for req, t in zip(reqs, got, strict=True):
            req.outputs.append(t)
    assert cuda.penalties.capacity == 8 and cuda.penalties.epoch == 1
