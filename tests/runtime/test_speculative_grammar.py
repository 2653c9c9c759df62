"""Speculation for grammar-bound requests: greedy token ids and logprobs identical with
speculation on and off (JSON schema, JSON object, regex; n-gram and a draft model; chunked
prompts, forced preemption); every output one the grammar accepts; the per-position masks
(:func:`draft_masks`) leave the matcher as it was and stop at the first refused draft or at
the grammar's end; a slow or busy grammar decodes without speculation; no leaked blocks."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.sched_output import RequestFacts, ScheduledChunk, SchedulerOutput
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.grammar import draft_masks, plain_when_grammar_busy
from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured.manager import RequestMatcher
from tests.runtime.test_speculative import SPEC, _engine, _requests
from tests.runtime.test_speculative_shaped import _assert_same, _run, _self_draft

GRAMMARS = {
    "schema": StructuredOutputsParams.json_schema({
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}}}),
    "json-object": StructuredOutputsParams.json_object(),
    "regex": StructuredOutputsParams.regex("(the cat |a dog )+end"),
}  # fmt: skip


def _grammar_requests(name: str, **extra) -> list[tuple[list[int], SamplingParams]]:
    return [(prompt, SamplingParams(max_tokens=40, temperature=0.0, structured=GRAMMARS[name], **extra))
            for prompt, _ in _requests(1000)[:5]]  # fmt: skip


def _assert_grammar_accepts(engine: LLMEngine, requests, out: dict[str, tuple]) -> None:
    for req_id, (_, token_ids, reason, _) in out.items():
        params = requests[int(req_id)][1]
        assert reason in ("stop", "length"), (req_id, reason)
        matcher = engine.structured.new_matcher(params.structured).matcher
        assert matcher.consume_tokens(list(token_ids)), (req_id, token_ids)
        assert reason == "length" or matcher.is_stopped() or matcher.is_accepting()


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_grammar_requests_speculate_to_the_same_greedy_tokens(model_factory, grammar: str, method: str) -> None:
    model_dir = model_factory("llama")
    requests = _grammar_requests(grammar, logprobs=2)
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, SPEC if method == "ngram" else _self_draft(model_dir))
    on = _run(engine, requests)
    _assert_same(on, off)
    _assert_grammar_accepts(engine, requests, on)
    assert all(len(v[3]) == len(v[1]) for v in on.values())
    if grammar != "regex":  # the regex's short output rarely repeats an n-gram
        assert engine.stats().spec_num_accepted_tokens > 0, engine.stats()


@pytest.mark.parametrize("case", ["chunked", "preemption"])
def test_grammar_speculation_with_chunking_and_preemption(model_factory, case: str) -> None:
    model_dir = model_factory("qwen3")
    knobs = {"chunked": dict(max_num_tokens=24), "preemption": dict(num_kv_blocks=14, enable_prefix_caching=False)}
    requests = _grammar_requests("schema", presence_penalty=0.2)
    requests[1::2] = _grammar_requests("json-object")[1::2]
    off = _run(_engine(model_dir, None, **knobs[case]), requests)
    engine = _engine(model_dir, SPEC, **knobs[case])
    on = _run(engine, requests)
    _assert_same(on, off)
    _assert_grammar_accepts(engine, requests, on)
    assert engine.stats().spec_num_drafts > 0


def test_a_busy_grammar_decodes_without_speculation(model_factory) -> None:
    """A grammar under an (already released) injected stall counts as busy: it never
    speculates, and its tokens are those of a run without speculation."""
    model_dir = model_factory("llama")
    requests = _grammar_requests("schema")[:2]
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, SPEC)
    released = threading.Event()
    released.set()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
        engine.output_processor.matcher_of(engine.scheduler.waiting[-1].req_id).stall = released
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert {k: tuple(v) for k, v in got.items()} == {k: v[1] for k, v in off.items()}
    assert engine.stats().spec_num_drafts == 0 and engine.stats().num_used_kv_blocks == 0


def _matcher(engine: LLMEngine, grammar: str) -> RequestMatcher:
    return engine.structured.new_matcher(GRAMMARS[grammar])


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(model_factory) -> None:
    engine = _engine(model_factory("llama"), None)
    tok, vocab = engine.tokenizer, engine.vocab_size
    matcher = _matcher(engine, "regex")
    ids = tok.encode("a dog the cat end", add_special_tokens=False)
    before = draft_masks(matcher, (), vocab)
    assert before.shape[0] == 1
    masks = draft_masks(matcher, tuple(ids[:3]), vocab)
    assert masks.shape[0] == 4 and np.array_equal(masks[0], before[0])  # one row per position
    for i, token in enumerate(ids[:3]):
        assert masks[i, token // 32] >> (token % 32) & 1  # each draft is allowed at its own row
    assert np.array_equal(draft_masks(matcher, (), vocab), before)  # rolled back
    refused = tok.encode("a dog", add_special_tokens=False)[:1] + tok.encode("zzz", add_special_tokens=False)
    assert draft_masks(matcher, tuple(refused), vocab).shape[0] == 2  # rows 0 and 1: draft 1 is refused there
    whole = tuple(ids) + tuple(ids)
    assert draft_masks(matcher, whole, vocab).shape[0] == len(ids)  # no row after the grammar's end
    assert matcher.matcher.consume_tokens(ids) and matcher.matcher.is_stopped()


@pytest.mark.parametrize(("state", "speculates"), [
    ({}, True), ({"slow": True}, False), ({"fill": object()}, False), ({"pending_token": 5}, False),
    ({"failed": True}, False), ({"stall": threading.Event()}, False),
])  # fmt: skip
def test_only_a_quick_idle_grammar_speculates(state: dict, speculates: bool) -> None:
    matcher = RequestMatcher(None)  # type: ignore[arg-type]  # only its state is read
    for name, value in state.items():
        setattr(matcher, name, value)
    chunks = (ScheduledChunk("free", 9, 3, (8,), (1, 2), True, RequestFacts("free", 4, None), (4, 5)),
              ScheduledChunk("bound", 9, 1 + 3, (8,), (1, 2), True, RequestFacts("bound", 4, None), num_model_drafts=3))
    sched = SchedulerOutput(chunks, (), (), 7)
    out = plain_when_grammar_busy(sched, lambda req_id: matcher if req_id == "bound" else None)
    assert out.chunks[0] is chunks[0]
    if speculates:
        assert out is sched
    else:
        assert out.chunks[1].num_tokens == 1 and not out.chunks[1].speculative and out.num_batched_tokens == 4


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_grammar_requests_speculate_within_the_grammar(model_factory, method: str) -> None:
    model_dir = model_factory("llama")
    requests = [(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=i, structured=GRAMMARS["schema"]))
                for i, (prompt, _) in enumerate(_requests(1000)[:4])]  # fmt: skip
    engine = _engine(model_dir, SPEC if method == "ngram" else _self_draft(model_dir))
    out = _run(engine, requests)
    _assert_grammar_accepts(engine, requests, out)
    assert engine.stats().spec_num_drafts > 0
