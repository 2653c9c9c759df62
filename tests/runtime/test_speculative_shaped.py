"""Speculation for requests whose distribution is shaped: ``logprobs`` / top alternatives,
repetition / presence / frequency penalties and ``logit_bias``. Greedy: token ids, and the
logprob entries of every emitted token (accepted drafts and the token after them) to float
tolerance, identical with speculation on and off (n-gram and a draft model; chunked prompts,
forced preemption, ``n`` choices, stop strings); verification rows that see the penalties as
of their own position (checked exactly against one-token-at-a-time sampling); sampled rows
that follow the penalized target distribution (chi-square); no leaked blocks."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.core.sched_output import RequestFacts, ScheduledChunk
from inflight.runtime.engine_core.output_text import OutputText, step_with_text
from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.verify import verify_chunk
from inflight.runtime.worker.sampler import Sampler, SamplingRow
from tests.runtime.test_speculative import CASE_KNOBS, SPEC, _engine, _requests

CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}  # chi-square critical values at p = 0.001
SHAPES = {
    "logprobs": dict(logprobs=3),
    "logprobs-0": dict(logprobs=0),
    # mild enough that the output still repeats itself, so n-gram drafts are proposed and kept
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1, logprobs=2),
    "logit-bias": dict(logit_bias=((20, 3.0), (41, -100.0), (77, 2.5))),
}


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """req_id -> (text, token ids, finish reason, logprob entries or None)."""
    out: dict[str, list] = {}
    text = OutputText(engine.tokenizer, engine.eos_token_ids)  # the one text path, as LLM takes it
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
        text.add(str(i), params)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in step_with_text(engine, text):
            entry = out.setdefault(o.req_id, ["", [], None, None])
            entry[0] += o.new_text
            entry[1].extend(o.new_token_ids)
            if o.new_logprobs is not None:
                entry[3] = (entry[3] or []) + list(o.new_logprobs)
            if o.finished:
                entry[2] = o.finish_reason
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return {k: (v[0], tuple(v[1]), v[2], v[3]) for k, v in out.items()}


def _same_logprobs(on: list[TokenLogprob] | None, off: list[TokenLogprob] | None) -> None:
    assert (on is None) == (off is None)
    if on is None or off is None:
        return
    assert [e.token_id for e in on] == [e.token_id for e in off]
    for a, b in zip(on, off, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def _assert_same(on: dict[str, tuple], off: dict[str, tuple]) -> None:
    assert {k: v[:3] for k, v in on.items()} == {k: v[:3] for k, v in off.items()}
    for req_id, value in off.items():
        _same_logprobs(on[req_id][3], value[3])


def _shaped(shape: str, **extra) -> list[tuple[list[int], SamplingParams]]:
    return [(prompt, SamplingParams(**{"max_tokens": params.max_tokens, "temperature": 0.0, "ignore_eos": True,
                                       **SHAPES[shape], **extra}))
            for prompt, params in _requests(1000)]  # fmt: skip


def _self_draft(model_dir) -> str:
    return json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tokens_and_logprobs_are_identical_with_speculation_on_and_off(model_factory, shape: str,
                                                                              method: str) -> None:
    model_dir = model_factory("llama")
    requests = _shaped(shape)
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, SPEC if method == "ngram" else _self_draft(model_dir))
    on = _run(engine, requests)
    _assert_same(on, off)
    if "logprobs" in SHAPES[shape]:
        assert all(len(v[3]) == len(v[1]) for v in on.values())  # one entry per emitted token
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats


@pytest.mark.parametrize("case", ["chunked", "preemption", "prefix-cache"])
def test_shaped_identity_holds_with_chunking_preemption_and_prefix_hits(model_factory, case: str) -> None:
    model_dir = model_factory("qwen2")
    knobs = CASE_KNOBS[case]
    requests = _shaped("penalties")
    requests[1::2] = _shaped("logit-bias", logprobs=1)[1::2]
    off = _run(_engine(model_dir, None, **knobs), requests)
    engine = _engine(model_dir, SPEC, **knobs)
    _assert_same(_run(engine, requests), off)
    assert engine.stats().spec_num_drafts > 0
    if case == "preemption":
        assert engine.stats().num_preemptions > 0


def test_stop_strings_and_n_choices_with_logprobs_and_penalties(model_factory) -> None:
    """A stop string inside a speculated run of tokens ends the request there, with one
    logprob entry per token kept; the ``n`` greedy choices of one request agree."""
    model_dir = model_factory("mistral")
    base = _shaped("penalties", max_tokens=30)[:3]
    free = _run(_engine(model_dir, None), base)
    stop = free["1"][0][4:7]
    requests = [base[0], (base[1][0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop],
                                                     logprobs=2, frequency_penalty=0.5))]  # fmt: skip
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, SPEC)
    on = _run(engine, requests)
    _assert_same(on, off)
    assert on["1"][2] == "stop" and stop not in on["1"][0] and len(on["1"][3]) == len(on["1"][1])

    def choices(spec: str | None) -> dict[str, tuple]:
        engine = _engine(model_dir, spec, enable_prefix_caching=True)
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2, presence_penalty=0.6)
        engine.add_requests([EngineRequest(f"c{c}", list(base[2][0]), params) for c in range(3)])
        got: dict[str, tuple] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                ids, lps = got.get(o.req_id, ((), ()))
                got[o.req_id] = (ids + o.new_token_ids, lps + (o.new_logprobs or ()))
        assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
        return got

    c_off, c_on = choices(None), choices(SPEC)
    assert {v[0] for v in c_on.values()} == {c_off["c0"][0]}
    for value in c_on.values():
        _same_logprobs(list(value[1]), list(c_off["c0"][1]))


def _chunk(drafts: tuple[int, ...]) -> ScheduledChunk:
    """A speculating chunk of a made-up request: its last token 0 at position 3, then ``drafts``."""
    return ScheduledChunk("r", 3, 1 + len(drafts), (0,), (0,), True, RequestFacts("r", 3, None), drafts)


def _row(params: SamplingParams, output: list[int], gen: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params, [1, 2, 3], output, gen, (0,))


def test_each_verification_row_sees_the_penalties_of_its_own_position() -> None:
    """Greedy: verify_chunk's tokens and logprobs equal those of the sampler decoding the same
    rows one at a time, each after the tokens before it (drafts of the row's past included)."""
    torch.manual_seed(3)
    vocab, k = 12, 4
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.8, presence_penalty=1.2,
                            frequency_penalty=0.9, logit_bias=((5, 1.5),), logprobs=3)  # fmt: skip
    logits = torch.randn(k + 1, vocab)
    output = [4, 7]
    expected: list[int] = []
    entries = []
    for i in range(k + 1):  # one token at a time: the drafts are what the sampler picks
        got = Sampler(torch.device("cpu")).sample(logits[i : i + 1].clone(), [_row(params, output + expected)])
        expected.append(got.token_ids[0])
        entries.append(got.logprobs[0])
    assert len(set(expected)) > 1  # the penalties changed the picks along the way
    for wrong_at in [None, 2]:  # all drafts right, or the third replaced
        drafts = list(expected[:k])
        if wrong_at is not None:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab
        chunk = _chunk(tuple(drafts))
        tokens, logprobs = verify_chunk(logits.clone(), chunk, _row(params, output))
        n = k + 1 if wrong_at is None else wrong_at + 1
        assert list(tokens) == expected[:n]
        for a, b in zip(logprobs, entries[:n], strict=True):
            assert a is not None and b is not None and a.token_id == b.token_id and a.top == b.top
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)


def test_sampled_rows_follow_the_penalized_target() -> None:
    """Chi-square: with a frequency penalty and a bias, the first emitted token follows row 0's
    penalized distribution, and the token after a kept draft ``d`` follows row 1 penalized with
    ``d`` counted."""
    torch.manual_seed(0)
    vocab, temperature = 6, 0.9
    logits = torch.randn(2, vocab)
    params = SamplingParams(temperature=temperature, max_tokens=8, seed=1, frequency_penalty=1.5,
                            logit_bias=((3, 1.0),))  # fmt: skip
    output = [2, 2]
    draft = 1

    def target(row: int, seen: list[int]) -> torch.Tensor:
        shaped = logits[row].clone()
        shaped[3] += 1.0
        shaped -= 1.5 * torch.bincount(torch.tensor(seen), minlength=vocab).float()
        return torch.softmax(shaped / temperature, dim=-1)

    gen = torch.Generator().manual_seed(11)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    chunk = _chunk((draft,))
    for _ in range(8000):
        tokens, logprobs = verify_chunk(logits.clone(), chunk, _row(params, output, gen))
        assert logprobs == (None,) * len(tokens)
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    for counts, probs in [(first, target(0, output)), (second, target(1, [*output, draft]))]:
        expected = probs * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_999[vocab - 1], (counts.tolist(), expected.tolist())


def test_a_draft_model_proposes_under_the_same_penalties_and_bias(model_factory) -> None:
    """The target as its own draft keeps (nearly) every draft even when strong penalties and a
    bias move the target's picks away from its raw argmax: the draft's logits are shaped too."""
    model_dir = model_factory("llama")
    strong = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.4,
                  logit_bias=((20, 4.0), (41, -100.0)), logprobs=1)  # fmt: skip
    requests = [(prompt, SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, **strong))
                for prompt, params in _requests(1000)[:5]]  # fmt: skip
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, _self_draft(model_dir))
    _assert_same(_run(engine, requests), off)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 20
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens, stats


def test_a_steps_chunks_verified_together_equal_each_alone_with_one_host_read() -> None:
    """verify_chunks over a step's speculating chunks (greedy with penalties and logprobs, plain
    greedy, seeded sampling) gives each chunk's tokens and entries as verify_chunk alone does, and
    its greedy chunks cost one host read together, not one each."""
    from inflight.runtime.spec_decode.verify import verify_chunks
    from tests.runtime.test_sampler_batched import _SyncCounter

    torch.manual_seed(5)
    vocab = 12
    shaped = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.8, logit_bias=((5, 1.5),),
                            logprobs=2)  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=4, top_k=6)
    cases = [(shaped, (3, 5, 3)), (plain, (1, 2)), (seeded, (7,)), (plain, (4, 4, 4, 4))]
    logits = [torch.randn(len(d) + 1, vocab) for _, d in cases]
    for i, (_, drafts) in enumerate(cases):  # plain greedy chunks keep some drafts, then miss
        if i in (1, 3):
            logits[i][0, drafts[0]] += 10.0
    alone = [verify_chunk(block.clone(), _chunk(drafts), _row(p, [4, 7], torch.Generator().manual_seed(9)))
             for block, (p, drafts) in zip(logits, cases, strict=True)]  # fmt: skip
    rows = [_row(p, [4, 7], torch.Generator().manual_seed(9)) for p, _ in cases]
    together = verify_chunks(torch.cat(logits), [_chunk(d) for _, d in cases], rows, [None] * len(cases))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert [len(t) for t, _ in together][1] >= 2 and [len(t) for t, _ in together][3] >= 2  # drafts kept
    for (_, a), (_, b) in zip(together, alone, strict=True):
        _same_logprobs(list(a) if a[0] is not None else None, list(b) if b[0] is not None else None)
    greedy = [(p, d) for p, d in cases if p.greedy and p.logprobs is None]
    with _SyncCounter() as counter:
        verify_chunks(torch.cat([torch.randn(len(d) + 1, vocab) for _, d in greedy]), [_chunk(d) for _, d in greedy],
                      [_row(p, [4, 7]) for p, _ in greedy], [None] * len(greedy))  # fmt: skip
    assert counter.count == 1
    with _SyncCounter() as counter:  # the counter is not blind: chunk by chunk, one read each
        for p, d in greedy:
            verify_chunk(torch.randn(len(d) + 1, vocab), _chunk(d), _row(p, [4, 7]))
    assert counter.count == len(greedy)


@pytest.mark.parametrize("seed", range(6))
def test_a_mixed_step_reads_its_argmaxes_and_draws_together_on_the_device(seed: int) -> None:
    """With the draws on the device (forced on the CPU), a step of greedy and sampled chunks reads
    the greedy chunks' argmaxes and every sampled chunk's result in one host read, and gives the
    tokens, and leaves each generator, as the host's draft-by-draft path does."""
    from inflight.runtime.spec_decode.verify import verify_chunks
    from tests.runtime.test_sampler_batched import _SyncCounter

    torch.manual_seed(seed)
    vocab = 16
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    hot = SamplingParams(temperature=0.9, max_tokens=20, seed=3)
    cases = [(plain, (3, 5)), (hot, (7, 2, 9)), (plain, (1,)), (hot, ()), (plain, (4, 4, 4)), (hot, (6,))]
    logits = torch.randn(sum(len(d) + 1 for _, d in cases), vocab) * 2.0
    first = 0
    for p, drafts in cases:  # some drafts are the target's pick, so chunks keep some of them
        for j, d in enumerate(drafts[:2]):
            logits[first + j, d] += 10.0 if p.greedy else 3.0
        first += len(drafts) + 1

    def run(on_device: bool) -> tuple[list, list]:
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(cases))]
        rows = [_row(p, [4, 7], gens[i] if not p.greedy else None) for i, (p, _) in enumerate(cases)]
        got = verify_chunks(logits.clone(), [_chunk(d) for _, d in cases], rows, [None] * len(cases),
                            on_device=on_device)  # fmt: skip
        return [t for t, _ in got], [g.get_state() for g in gens]

    host_tokens, host_states = run(False)
    with _SyncCounter() as counter:
        device_tokens, device_states = run(True)
    assert device_tokens == host_tokens
    assert all(torch.equal(a, b) for a, b in zip(device_states, host_states, strict=True))
    assert counter.count == 1
    assert any(len(t) > 1 for t in host_tokens)  # drafts were kept somewhere: the accept paths ran
