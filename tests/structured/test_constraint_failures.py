"""A constraint the engine cannot keep is never a 200 that ignores it: too many choices are a
400 up front; a grammar whose matcher fails mid-generation (llguidance's row limit) ends the
request with an error (400 ``constraint_failed``, or an error event in a stream), never
``stop`` with text the grammar does not match; min_tokens beside a grammar is refused."""

from __future__ import annotations

import json

import pytest

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured.params import MAX_CHOICES
from tests.server.server_helpers import MODEL_NAME

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

# One Earley row with 3001 items: past llguidance's limit of 2000, so the first token fails.
WIDE_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(3000))


def test_a_grammar_that_fails_mid_generation_ends_with_an_error(llama_server) -> None:
    llm = LLM(llama_server.model_dir, device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0, structured=StructuredOutputsParams.grammar(WIDE_GRAMMAR))
    out = llm.generate(["x"], params)[0]
    assert out.finish_reason == "error"
    engine = llm.engine
    assert engine.stats().num_used_kv_blocks == 0 and not engine.has_unfinished_requests()


def test_the_server_answers_it_as_the_clients_error(llama_server) -> None:
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)
    body = {"structured_outputs": {"grammar": WIDE_GRAMMAR}}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, extra_body=body)
    assert info.value.body["code"] == "constraint_failed" and "row has 3001 items" in info.value.body["message"]
    stream = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, stream=True, extra_body=body)
    with pytest.raises(openai.APIError) as streamed:
        for _ in stream:
            pass
    assert "constraint" in str(streamed.value)
    # The server goes on serving others.
    ok = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10,
                                   extra_body={"guided_choice": ["alpha", "beta"]}).choices[0]
    assert ok.text in ("alpha", "beta")


def test_too_many_choices_is_400(llama_server) -> None:
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                  extra_body={"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]})
    assert info.value.body["param"] == "guided_choice" and str(MAX_CHOICES) in info.value.body["message"]


def test_min_tokens_with_a_grammar_is_refused(llama_server) -> None:
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8,
                                  extra_body={"min_tokens": 2, "guided_json": json.dumps({"type": "object"})})
    assert info.value.body["param"] == "min_tokens"
