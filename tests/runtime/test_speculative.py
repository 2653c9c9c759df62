"""Speculative decoding with n-gram proposals: vLLM's config, the proposer, greedy output
identical with speculation on and off (four architectures, chunked prompts, forced
preemption, prefix caching, several choices of one prompt, stop strings, a grammar-bound
request in the same batch), rejection sampling that keeps the target distribution (a
chi-square test), max_tokens and EOS honoured exactly, an abort right after a speculating
step, the ``n`` choices of one request (one engine group), no leaked blocks."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.engine_core.output_text import OutputText, step_with_text
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.speculative import NgramIndex, parse_speculative_config
from inflight.runtime.spec_decode.verify import verify_greedy, verify_sampled
from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.worker.sampler import SamplingRow

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1, "disable_by_batch_size": 64})  # fmt: skip


@pytest.mark.parametrize(("text", "error"), [
    ('{"method": "ngram"}', None),
    ('{"method": "draft_model", "model": "/models/small"}', None),
    ('{"model": "/models/small"}', None),  # vLLM: a model without a method is a draft model
    ('{"method": "draft_model"}', 'method "draft_model" needs "model"'),
    ('{"method": "ngram", "model": "/models/small"}', 'which method "ngram" does not use'),
    ('{"method": "eagle", "model": "/models/small"}', 'method "eagle" .EAGLE-1/2 heads. is not served'),
    ('{"method": "medusa", "model": "/models/small"}', "speculative method must be one of ngram, draft_model, eagle3"),
    ('{"method": "draft_model", "model": "x", "draft_tensor_parallel_size": 2}', "unknown speculative_config key"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max must be an integer >= prompt_lookup_min"),
    ("[1]", "must be a JSON object"),
    ("{bad", "must be a JSON object"),
])  # fmt: skip
def test_speculative_config(text: str, error: str | None) -> None:
    if error is None:
        assert parse_speculative_config(text).num_speculative_tokens == 4
        assert EngineConfig(speculative_config=text).speculative_config == text
        return
    with pytest.raises(ValueError, match=error):
        EngineConfig(speculative_config=text)


@pytest.mark.parametrize(("tokens", "k", "want"), [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the longest suffix (1 2 3) continues with 4 5 1
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, [7, 2]),  # the latest earlier occurrence wins
    ([1, 2, 3, 4], 4, []),  # nothing repeats
    ([5, 6, 5], 4, [6, 5]),  # a 1-gram match
])  # fmt: skip
def test_ngram_proposals(tokens: list[int], k: int, want: list[int]) -> None:
    assert NgramIndex(1, 3).propose(tokens, k) == want


def test_the_index_grows_with_the_sequence() -> None:
    index, tokens = NgramIndex(2, 2), [1, 2, 3]
    assert index.propose(tokens, 2) == []
    tokens += [1, 2]
    assert index.propose(tokens, 2) == [3, 1]


def test_greedy_verification() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 7, 2, 9]):
        logits[row, best] = 5.0
    assert verify_greedy(logits, (3, 7, 2)) == [3, 7, 2, 9]  # all kept, plus a free token
    assert verify_greedy(logits, (3, 1, 2)) == [3, 7]  # the second is replaced, the rest dropped
    assert verify_greedy(logits[:1], ()) == [3]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Chi-square: the first token emitted, over many draws, follows the target distribution
    whatever was drafted (a likely draft, an unlikely one, or one the target never picks)."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    logits[:, 5] = float("-inf")  # the target never picks token 5
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=1)
    target = torch.softmax(logits[0] / 0.8, dim=-1)
    trials = 6000
    for drafts in [(int(target.argmax()), 1), (int(target.argmin()), 0), (5, 2)]:
        gen = torch.Generator().manual_seed(hash(drafts) % 1000)
        row = SamplingRow(params, [1], [], gen, (0,))
        counts = torch.zeros(vocab)
        for _ in range(trials):
            counts[verify_sampled(logits, drafts, row)[0]] += 1
        assert counts[5] == 0
        expected = target * trials
        mask = expected > 0
        chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
        assert chi2 < 20.5, (drafts, chi2, counts.tolist(), expected.tolist())  # p = 0.001 at 4 dof


# Engine knobs that force chunked prompts, preemption and prefix-cache hits.
CASE_KNOBS = {"chunked": dict(max_num_tokens=24), "preemption": dict(num_kv_blocks=14, enable_prefix_caching=False),
              "prefix-cache": dict(enable_prefix_caching=True)}  # fmt: skip


def _engine(model_dir, spec: str | None, **knobs) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256, speculative_config=spec)
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**config, **knobs}))


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    out: dict[str, list] = {}
    finish: dict[str, str] = {}
    text = OutputText(engine.tokenizer, engine.eos_token_ids)  # the one text path, as LLM takes it
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
        text.add(str(i), params)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in step_with_text(engine, text):
            entry = out.setdefault(o.req_id, ["", []])
            entry[0] += o.new_text
            entry[1].extend(o.new_token_ids)
            if o.finished:
                finish[o.req_id] = o.finish_reason
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return {k: (v[0], tuple(v[1]), finish[k]) for k, v in out.items()}


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Repetitive prompts (so proposals are made and often right), of several lengths."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    pattern = [(7 * j + 3) % (vocab - 10) + 5 for j in range(9)]
    reqs = [((pattern * 8)[: 10 + 13 * i], SamplingParams(max_tokens=20 + i, **greedy)) for i in range(6)]
    reqs += [(pattern * 3, SamplingParams(max_tokens=17, **greedy))] * 2  # two choices of one prompt
    return reqs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_with_speculation_on_and_off(model_factory, arch: str) -> None:
    model_dir = model_factory(arch)
    requests = _requests(1000)
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, SPEC)
    on = _run(engine, requests)
    assert on == off
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats


@pytest.mark.parametrize("case", ["chunked", "preemption", "prefix-cache"])
def test_greedy_identity_holds_with_chunking_preemption_and_prefix_hits(model_factory, case: str) -> None:
    model_dir = model_factory("llama")
    knobs = CASE_KNOBS[case]
    requests = _requests(1000)
    off_engine = _engine(model_dir, None, **knobs)
    on_engine = _engine(model_dir, SPEC, **knobs)
    assert _run(on_engine, requests) == _run(off_engine, requests)
    if case == "preemption":
        assert on_engine.stats().num_preemptions > 0
    if case == "prefix-cache":
        assert on_engine.stats().prefix_cache_hits > 0


def test_stop_strings_eos_max_tokens_and_grammars_beside_speculation(model_factory) -> None:
    model_dir = model_factory("qwen2")
    engine = _engine(model_dir, None)
    base = _requests(1000)[:3]
    free = _run(engine, base)
    stop = free["1"][0][3:6]  # a string the greedy text reaches: it must end the request there
    schema = StructuredOutputsParams.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    requests = [
        (base[0][0], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
        (base[1][0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])),
        (base[2][0], SamplingParams(max_tokens=30, temperature=0.0)),  # may stop at EOS
        (base[2][0], SamplingParams(max_tokens=12, temperature=0.0, structured=schema)),  # speculates under its masks
    ]
    off = _run(_engine(model_dir, None), requests)
    spec_engine = _engine(model_dir, SPEC)
    on = _run(spec_engine, requests)
    assert on == off
    assert len(on["0"][1]) == 7 and on["0"][2] == "length"
    assert on["1"][2] == "stop" and stop not in on["1"][0]
    assert spec_engine.stats().spec_num_drafts > 0


def test_sampled_requests_speculate_and_finish(model_factory) -> None:
    model_dir = model_factory("llama")
    engine = _engine(model_dir, SPEC)
    params = [SamplingParams(max_tokens=25, temperature=0.7, top_p=0.9, top_k=50, seed=i, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    out = _run(engine, [(p, q) for (p, _), q in zip(_requests(1000)[:4], params, strict=True)])
    assert all(len(tokens) == 25 and reason == "length" for _, tokens, reason in out.values())
    assert engine.stats().spec_num_drafts > 0


def test_no_speculation_from_the_batch_size_cut_off(model_factory) -> None:
    model_dir = model_factory("llama")
    spec = json.dumps({"method": "ngram", "disable_by_batch_size": 2})
    engine = _engine(model_dir, spec)
    _run(engine, _requests(1000)[:4])  # 4 running >= 2 for most steps
    few = engine.stats().spec_num_drafts
    engine2 = _engine(model_dir, spec)
    _run(engine2, _requests(1000)[:1])  # alone: speculates
    assert engine2.stats().spec_num_drafts > few


def test_speculating_rows_run_on_decode_graphs(model_factory) -> None:
    """Draft rows are decode rows (each attends up to itself), so a speculating step can
    replay a captured decode graph: tokens stay those of the eager engine without speculation."""
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    model_dir = model_factory("mistral")
    requests = _requests(1000)[:4]
    off = _run(_engine(model_dir, None), requests)
    backend = RecordingGraphBackend()
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256,
                          kernel_backend="cpu", max_num_sequences=32, speculative_config=SPEC)  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
    assert _run(engine, requests) == off
    assert backend.num_replays > 0 and engine.stats().spec_num_drafts > 0


def _spy_drafts(engine: LLMEngine) -> set[str]:
    """The ids of the requests the latest step scheduled with draft tokens."""
    drafted: set[str] = set()
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202 (the scheduler's own return type)
        out = schedule()
        drafted.clear()
        drafted.update(c.req_id for c in out.chunks if c.speculative)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return drafted


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_an_abort_while_speculating_leaks_nothing_and_leaves_the_others_alone(model_factory, method: str) -> None:
    """The victim shares its prompt's cached blocks with another request, holds KV slots of
    rejected drafts when aborted, and the others' greedy tokens stay those of a run without
    speculation and without the victim; a later request that reuses the victim's cached
    prefix still gets the right tokens (with a draft model: the target as its own draft)."""
    model_dir = model_factory("llama")
    spec = SPEC if method == "ngram" else json.dumps({"method": "draft_model", "model": str(model_dir),
                                                      "num_speculative_tokens": 4, "disable_by_batch_size": 64})
    requests = _requests(1000)[:4]
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    knobs = dict(enable_prefix_caching=True)
    expected = _run(_engine(model_dir, None, **knobs), requests)
    after = _run(_engine(model_dir, None, **knobs), [(requests[1][0], long)])["0"]
    engine = _engine(model_dir, spec, **knobs)
    drafted = _spy_drafts(engine)
    engine.add_request("victim", requests[1][0], long)
    got: dict[str, list[int]] = {}
    aborted_at_step = None
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        if step == 1:  # the victim's prompt is computed and cached: the others share it
            for i, (prompt, params) in enumerate(requests):
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        if aborted_at_step is None and "victim" in drafted and len(got) > 1:  # it just speculated
            abort = engine.abort_request("victim")
            assert abort is not None and abort.finish_reason == "abort"
            aborted_at_step = step
    assert aborted_at_step is not None, "the victim never speculated beside the others"
    assert len(got["victim"]) < long.max_tokens
    assert {k: tuple(v) for k, v in got.items() if k != "victim"} == {k: v[1] for k, v in expected.items()}
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    assert _run(engine, [(requests[1][0], long)])["0"] == after  # its cached prefix is sound
    assert engine.stats().prefix_cache_hits > 0


def test_n_choices_of_one_request_speculate_to_the_same_greedy_tokens(model_factory) -> None:
    """A request with ``n`` choices is ``n`` engine requests added as one group: greedy, every
    choice equals the others and the run without speculation; seeded sampled choices each
    finish their length; nothing leaks."""

    model_dir = model_factory("qwen3")
    prompt = _requests(1000)[2][0]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=20, temperature=0.8, seed=7 + c, ignore_eos=True) for c in range(3)]

    off, _ = run_choices(_engine(model_dir, None, enable_prefix_caching=True), prompt, greedy, sampled)
    on, engine = run_choices(_engine(model_dir, SPEC, enable_prefix_caching=True), prompt, greedy, sampled)
    assert {on[f"g{c}"] for c in range(4)} == {off["g0"]} and len(off["g0"]) == 24
    assert all(len(on[f"s{c}"]) == 20 for c in range(3))
    assert engine.stats().spec_num_drafts > 0 and engine.stats().spec_num_accepted_tokens > 0


def run_choices(engine: LLMEngine, prompt: list[int], greedy: SamplingParams,
                sampled: list[SamplingParams]) -> tuple[dict[str, tuple[int, ...]], LLMEngine]:
    """Four greedy choices (``g0``..) and the ``sampled`` ones (``s0``..) of one prompt, run to
    the end: each choice's tokens, and the engine (its blocks checked for leaks)."""
    engine.add_requests([EngineRequest(f"g{c}", list(prompt), greedy) for c in range(4)])
    engine.add_requests([EngineRequest(f"s{c}", list(prompt), p) for c, p in enumerate(sampled)])
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return {k: tuple(v) for k, v in tokens.items()}, engine
