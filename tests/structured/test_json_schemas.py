"""Twenty JSON schemas through the official openai client, streamed and not, on random-weight
llama and qwen3 models: every output parses and validates, and ends because the grammar did."""

from __future__ import annotations

import json

import pytest
from schemas import SCHEMAS

from tests.server.server_helpers import MODEL_NAME, client_for

jsonschema = pytest.importorskip("jsonschema")  # absent on a bare GPU machine (docs/gpu.md)

MESSAGES = [{"role": "user", "content": "Describe the thing as JSON."}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_schema_output_validates(any_server, index: int, stream: bool) -> None:
    schema = SCHEMAS[index]
    client = client_for(any_server)
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=150, seed=index, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}},
    )
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", f"the grammar did not complete within max_tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema)


def test_stream_and_whole_agree(llama_server) -> None:
    client = client_for(llama_server)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, seed=7, temperature=1.0,
                  response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[9]}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == whole


def test_completions_endpoint_and_vllm_extras(llama_server) -> None:
    client = client_for(llama_server)
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100, temperature=1.0, seed=3,
                                    extra_body={"guided_json": SCHEMAS[8]}).choices[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMAS[8])
    regex = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=40, temperature=1.0,
                                      extra_body={"guided_regex": "[a-z]{2,5}@[a-z]{2,4}\\.(com|org)"}).choices[0]
    assert regex.finish_reason == "stop"
    assert __import__("re").fullmatch("[a-z]{2,5}@[a-z]{2,4}\\.(com|org)", regex.text)
    for body in ({"guided_choice": ["alpha", "beta"]}, {"structured_outputs": {"choice": ["alpha", "beta"]}}):
        for seed in range(3):
            pick = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10, seed=seed,
                                             extra_body=body).choices[0]
            assert pick.text in ("alpha", "beta") and pick.finish_reason == "stop"
    grammar = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'
    g = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=40, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"grammar": grammar}}).choices[0]
    assert g.finish_reason == "stop" and __import__("re").fullmatch(r"\([0-9](\+[0-9])*\)", g.text)


def test_json_object_with_logit_bias(llama_server) -> None:
    """Any JSON object is unbounded for a random model; a logit bias on '}' (composed with the
    grammar) makes it close: the grammar still forces the opening brace."""
    tok = llama_server.engine.tokenizer
    close = tok.convert_tokens_to_ids("}")
    client = client_for(llama_server)
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=20, response_format={"type": "json_object"},
        logit_bias={str(close): 100},
    ).choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content) == {}


def test_n_choices_each_validate(qwen3_server) -> None:
    client = client_for(qwen3_server)
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=150, n=4, seed=11, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[18]}},
    )
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[18])
