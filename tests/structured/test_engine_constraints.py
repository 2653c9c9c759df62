"""Engine-level checks of grammar-constrained decoding: constrained and free requests share a
batch without changing the free ones, preemption (recompute) does not re-advance a matcher,
compiled grammars are cached, and the bitmask handles logits wider than the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from schemas import SCHEMAS

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.engine_core.output_text import OutputText, step_with_text
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured.bitmask import apply_bitmask

jsonschema = pytest.importorskip("jsonschema")  # absent on a bare GPU machine (docs/gpu.md)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("engine-structured") / "qwen3", arch="qwen3", size="tiny")


def _run(engine: LLMEngine, requests: dict[str, SamplingParams],
         prompt_ids: list[int] | None = None) -> dict[str, tuple[str, str]]:
    """Run ``requests`` to the end (each on its own prompt unless ``prompt_ids`` is shared)."""
    texts = {r: "" for r in requests}
    reasons: dict[str, str] = {}
    text = OutputText(engine.tokenizer, engine.eos_token_ids)
    for req_id, params in requests.items():
        engine.add_request(req_id, prompt_ids or engine.encode_prompt(f"prompt {req_id}"), params)
        text.add(req_id, params)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in step_with_text(engine, text):
            texts[out.req_id] += out.new_text
            if out.finished:
                reasons[out.req_id] = out.finish_reason or ""
    return {r: (texts[r], reasons[r]) for r in requests}


def _schema_params(i: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=150, structured=StructuredOutputsParams.json_schema(SCHEMAS[i]), **kw)


def test_free_rows_unchanged_by_constrained_neighbours(model_dir: Path) -> None:
    cfg = EngineConfig(max_num_sequences=16, num_kv_blocks=512, max_model_len=512)
    free = {f"free{i}": SamplingParams(max_tokens=20, temperature=0.0) for i in range(4)}
    alone = _run(LLMEngine.from_model_dir(model_dir, cfg), free)
    mixed_reqs = {**free, **{f"json{i}": _schema_params(i, temperature=1.0, seed=i) for i in range(8)}}
    mixed = _run(LLMEngine.from_model_dir(model_dir, cfg), mixed_reqs)
    for req_id in free:
        assert mixed[req_id] == alone[req_id]
    for i in range(8):
        text, reason = mixed[f"json{i}"]
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_preemption_keeps_matchers_right(model_dir: Path) -> None:
    """A KV cache too small for the batch forces recompute; outputs still validate and equal
    the outputs of an engine that never preempts."""
    reqs = {f"r{i}": SamplingParams(max_tokens=70, structured=StructuredOutputsParams.json_schema(SCHEMAS[i]),
                                    temperature=1.0, seed=100 + i) for i in range(12)}
    roomy = LLMEngine.from_model_dir(model_dir, EngineConfig(max_num_sequences=12, num_kv_blocks=512, max_model_len=512))
    tight = LLMEngine.from_model_dir(model_dir, EngineConfig(max_num_sequences=12, num_kv_blocks=20, max_model_len=512,
                                                             block_size=4))
    expected = _run(roomy, reqs)
    got = _run(tight, reqs)
    assert tight.stats().num_preemptions > 0
    assert got == expected
    for i, (text, reason) in enumerate(got[f"r{i}"] for i in range(12)):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_stop_strings_and_logprobs_with_a_grammar(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=512))
    regex = StructuredOutputsParams.regex("ab(cd)+e")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured=regex, stop=("cd",), logprobs=2)
    engine.add_request("s", engine.encode_prompt("x"), params)
    text = OutputText(engine.tokenizer, engine.eos_token_ids)  # stop strings: the one text path
    text.add("s", params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(step_with_text(engine, text))
    assert "".join(o.new_text for o in outs) == "ab" and outs[-1].finish_reason == "stop"
    logprobs = [lp for o in outs for lp in (o.new_logprobs or ())]
    assert logprobs and all(lp.logprob <= 0.0 and len(lp.top) == 2 for lp in logprobs)


def test_grammar_compiled_once(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=512))
    a = StructuredOutputsParams.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}})
    b = StructuredOutputsParams.json_schema('{"type": "object",\n "properties": {"a": {"type": "integer"}, "b": {}}}')
    assert a == b
    engine.structured.submit(a).result(30)
    engine.structured.new_matcher(b)
    assert engine.structured.num_compiled == 1
    with pytest.raises(ValueError, match="invalid regex"):
        engine.structured.compile(StructuredOutputsParams.regex("a["))


def test_bitmask_disallows_padding_columns() -> None:
    logits = torch.zeros(3, 70)
    bitmask = __import__("numpy").full((1, 2), -1, dtype="int32")  # 64 tokens allowed
    bitmask[0, 0] = 0b101  # only tokens 0 and 2 in the first word
    apply_bitmask(logits, [1], bitmask)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [0, 2, *range(32, 64)]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_padded_vocabulary_never_samples_padding(tmp_path: Path, model_dir: Path) -> None:
    """Real checkpoints pad the embedding past the tokenizer (Qwen: 151936 rows, 151665
    tokens). The grammar's mask covers the logits' width, so padding ids are never chosen."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model.resize_token_embeddings(len(tokenizer) + 61)
    with torch.no_grad():  # make the padding rows the most likely tokens everywhere
        model.get_output_embeddings().weight[len(tokenizer):] = 5.0 * model.get_output_embeddings().weight[:61]
        model.get_output_embeddings().bias = None
    padded = tmp_path / "padded"
    model.save_pretrained(str(padded))
    tokenizer.save_pretrained(str(padded))
    engine = LLMEngine.from_model_dir(padded, EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=512))
    assert engine.runner.spec.vocab_size == len(tokenizer) + 61
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=StructuredOutputsParams.json_schema(SCHEMAS[9]))
    engine.add_request("p", engine.encode_prompt("x"), params)
    output_text = OutputText(engine.tokenizer, engine.eos_token_ids)
    output_text.add("p", params)
    ids, text = [], ""
    while engine.has_unfinished_requests():
        for out in step_with_text(engine, output_text):
            ids.extend(out.new_token_ids)
            text += out.new_text
    assert max(ids) < len(tokenizer)
    jsonschema.validate(json.loads(text), SCHEMAS[9])
    engine.add_request("free", engine.encode_prompt("x"), SamplingParams(max_tokens=20, temperature=0.0))
    free_ids = []
    while engine.has_unfinished_requests():
        free_ids.extend(i for out in engine.step() for i in out.new_token_ids)
    assert max(free_ids) >= len(tokenizer), "the padding rows should win without a grammar (test premise)"


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.5, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.8, "min_p": 0.01, "repetition_penalty": 1.2},
], ids=["top_k", "top_p", "min_p", "combined"])
def test_grammar_with_truncated_sampling_on_prefix_cache_hits(model_dir: Path, sampling: dict) -> None:
    """Top-k/top-p/min-p truncate after the grammar's mask (a truncation can never bring back a
    masked token), and requests whose prompt is served from the prefix cache start their
    matcher from the prompt's end like any other: every output parses and validates."""
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(max_num_sequences=8, num_kv_blocks=256,
                                                              max_model_len=512))
    prompt = engine.encode_prompt("a shared system prompt, long enough to fill whole KV blocks " * 3)
    first = {"warm": _schema_params(0, seed=1, **sampling)}
    later = {f"r{i}": _schema_params(i, seed=10 + i, **sampling) for i in range(1, 7)}
    results = _run(engine, first, prompt)  # fills the prefix cache
    results.update(_run(engine, later, prompt))  # hit it
    assert engine.stats().prefix_cache_hits >= 6 * 16  # each later request found at least a block
    for req_id, index in [("warm", 0)] + [(f"r{i}", i) for i in range(1, 7)]:
        text, reason = results[req_id]
        assert reason == "stop", (req_id, text)
        jsonschema.validate(json.loads(text), SCHEMAS[index])
