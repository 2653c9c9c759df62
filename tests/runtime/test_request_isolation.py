"""No request can make a step fail for the others: the engine refuses what the loaded model
cannot run (token ids past the vocabulary, integers no tensor holds, a token budget that
could strand a prompt), and when a step raises anyway only the requests that cause it fail."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.outputs import EngineFatalError, RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine.from_model_dir(llama_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=128))


def _run(engine: LLMEngine) -> dict[str, tuple[str | None, list[int]]]:
    results: dict[str, tuple[str | None, list[int]]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            reason, ids = results.get(out.req_id, (None, []))
            results[out.req_id] = (out.finish_reason if out.finished else reason, ids + list(out.new_token_ids))
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_used_kv_blocks == 0
    return results


def _reference(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("ref", prompt, SamplingParams(**GREEDY))
    return _run(engine)["ref"][1]


@pytest.mark.parametrize("params,param", [
    (dict(min_tokens=1, stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(stop_token_ids=[1024]), "stop_token_ids"),
])
def test_vocab_bound_params_are_refused_before_queueing(engine: LLMEngine, params, param) -> None:
    with pytest.raises(RequestRejectedError) as exc:
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, **params))
    assert exc.value.param == param and exc.value.reason == "invalid_request"
    assert "[0, 1024)" in str(exc.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("params,fragment", [
    (dict(top_k=2**64), "top_k must be an integer in [-1, 2147483647]"),
    (dict(seed=2**64), "seed must be an integer in"),
    (dict(seed=-(2**63) - 1), "seed must be an integer in"),
    (dict(stop_token_ids=list(range(257))), "at most 256 ids"),
    (dict(stop=["x" * 257]), "at most 256 characters"),
    (dict(stop=[str(i) for i in range(17)]), "at most 16 strings"),
])
def test_integer_and_size_bounds(params, fragment) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**params)
    assert fragment in str(exc.value)
    assert len(str(exc.value)) < 300


def test_extreme_but_valid_values_run(engine: LLMEngine) -> None:
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, top_k=2**31 - 1, seed=2**64 - 1))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=3, seed=-(2**63), logprobs=20,
                                                      min_tokens=2, stop_token_ids=[1023]))
    results = _run(engine)
    assert {r[0] for r in results.values()} <= {"stop", "length"}


def test_chunked_context_off_needs_a_budget_of_a_whole_context(llama_dir, engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match=r"max_num_tokens \(64\) must be at least max_model_len \(128\)"):
        LLMEngine.from_model_dir(llama_dir, EngineConfig(
            enable_chunked_context=False, max_num_tokens=64, max_model_len=128, num_kv_blocks=16))
    off = LLMEngine.from_model_dir(llama_dir, EngineConfig(
        enable_chunked_context=False, max_num_tokens=128, max_model_len=128, num_kv_blocks=16))
    with pytest.raises(ValueError, match="chunked context is off"):
        off.update_config(max_num_tokens=127)
    assert off.config.max_num_tokens == 128
    assert engine.update_config(max_num_tokens=8).max_num_tokens == 8  # chunked context on: fine
    engine.update_config(max_num_tokens=2048)


def test_a_sampler_failure_fails_only_its_request(engine: LLMEngine, monkeypatch) -> None:
    prompts = {"ok0": [5, 6, 7], "ok1": [9, 10, 11, 12], "poison": [5, 6, 7]}
    expected = {name: _reference(engine, p) for name, p in prompts.items() if name != "poison"}
    real_sample = engine.sampler.sample

    def sample(logits, rows, *rest):
        if any(r.params.seed == 13 for r in rows):
            raise RuntimeError("injected sampler failure")
        return real_sample(logits, rows, *rest)

    monkeypatch.setattr(engine.sampler, "sample", sample)
    for name, prompt in prompts.items():
        extra = dict(seed=13, temperature=0.5, max_tokens=6) if name == "poison" else GREEDY
        engine.add_request(name, prompt, SamplingParams(**extra))
    results = _run(engine)
    assert results["poison"] == ("error", [])
    for name, ids in expected.items():
        assert results[name] == ("length", ids)


def test_a_forward_failure_fails_only_its_request(engine: LLMEngine, monkeypatch) -> None:
    expected = _reference(engine, [5, 6, 7])
    real_execute = engine.runner.execute

    def execute(batch):
        if 999 in batch.input_ids.tolist():
            raise IndexError("injected forward failure")
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("ok", [5, 6, 7], SamplingParams(**GREEDY))
    engine.add_request("poison", [999, 1, 2], SamplingParams(**GREEDY))
    results = _run(engine)
    assert results == {"ok": ("length", expected), "poison": ("error", [])}


def test_a_forward_that_fails_for_everyone_is_fatal(engine: LLMEngine, monkeypatch) -> None:
    def execute(batch):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("x", [5, 6, 7], SamplingParams(**GREEDY))
    engine.add_request("y", [8, 9], SamplingParams(**GREEDY))
    with pytest.raises(EngineFatalError, match="fails for each of its 2 requests"):
        engine.step()
    for req_id in ("x", "y"):
        engine.abort_request(req_id)
    assert engine.stats().num_used_kv_blocks == 0
