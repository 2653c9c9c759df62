"""Request parsing without an engine: field shapes, defaults, the chat/completions
differences, and that every refusal is a 400 naming its ``param``."""

from __future__ import annotations

import pytest

from inflight.runtime.sampling_params import ParamError, SamplingParams
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    parse_chat_request,
    parse_completion_request,
)

MSG = [{"role": "user", "content": "hi"}]


def test_completion_defaults() -> None:
    req = parse_completion_request({"prompt": "hello"})
    assert req.prompts == ("hello",) and req.messages is None and not req.is_chat
    assert req.params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS and req.params.temperature == 1.0
    assert (req.n, req.stream, req.include_usage, req.num_logprobs, req.priority) == (1, False, False, None, 0)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("a", ("a",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_prompt_shapes(prompt: object, expected: tuple) -> None:
    assert parse_completion_request({"prompt": prompt}).prompts == expected


def test_sampling_fields_reach_sampling_params() -> None:
    req = parse_completion_request({
        "prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 4, "min_p": 0.1,
        "seed": 3, "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.2,
        "stop": "END", "ignore_eos": True, "min_tokens": 2, "logprobs": 2, "priority": -1, "user": "u",
    })
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (7, 0.0, 0.5, 4, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.2)
    assert p.stop == ("END",) and p.ignore_eos and p.min_tokens == 2 and p.logprobs == 2
    assert (req.num_logprobs, req.priority, req.user) == (2, -1, "u")


def test_choice_seeds_are_seed_plus_index() -> None:
    req = parse_completion_request({"prompt": "x", "n": 3, "seed": 10})
    assert [req.params_for_choice(i).seed for i in range(3)] == [10, 11, 12]
    unseeded = parse_completion_request({"prompt": "x", "n": 2})
    assert unseeded.params_for_choice(1).seed is None


def test_chat_fields() -> None:
    req = parse_chat_request({"messages": MSG, "max_completion_tokens": 5, "max_tokens": 9,
                              "logprobs": True, "top_logprobs": 3, "stream": True,
                              "stream_options": {"include_usage": True}})
    assert req.is_chat and req.params.max_tokens == 5 and req.max_tokens_given
    assert req.num_logprobs == 3 and req.params.logprobs == 3 and req.include_usage
    assert parse_chat_request({"messages": MSG, "logprobs": True}).num_logprobs == 0
    assert parse_chat_request({"messages": MSG}).num_logprobs is None
    assert not parse_chat_request({"messages": MSG}).max_tokens_given


def test_chat_text_parts_are_joined() -> None:
    req = parse_chat_request({"messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert req.messages == ({"role": "system", "content": ""}, {"role": "user", "content": "ab"})


def test_off_values_of_unsupported_fields_are_accepted() -> None:
    parse_completion_request({"prompt": "x", "echo": False, "best_of": 1, "logit_bias": {}, "suffix": None})


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "model": 5}, "model"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["x"] * 65}, "prompt"),
])
def test_refusals_name_their_param(body: dict, param: str) -> None:
    with pytest.raises(APIError) as exc:
        parse_completion_request(body)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.type == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_refusals(body: dict, param: str) -> None:
    with pytest.raises(APIError) as exc:
        parse_chat_request(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_body_must_be_an_object() -> None:
    for body in ([], "x", 3, None):
        with pytest.raises(APIError):
            parse_completion_request(body)


def test_fields_left_out_keep_sampling_params_own_defaults() -> None:
    """No sampling default is typed twice: a body without sampling fields parses to
    ``SamplingParams()`` as it is."""
    assert parse_completion_request({"prompt": "x"}).params == SamplingParams()


@pytest.mark.parametrize(("body", "field"), [
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_k": 2**40}, "top_k"),
    ({"max_tokens": 2, "min_tokens": 5}, "min_tokens"), ({"stop": ["x" * 300]}, "stop"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids"), ({"seed": 2**70}, "seed"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
])
def test_an_out_of_bounds_sampling_field_is_named_by_the_typed_error(body: dict, field: str) -> None:
    with pytest.raises(APIError) as info:
        parse_completion_request({"prompt": "x", **body})
    assert info.value.status == 400 and info.value.param == field, info.value.message


def test_sampling_params_name_the_field_they_refuse() -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(frequency_penalty=9.0)
    assert info.value.field == "frequency_penalty" and isinstance(info.value, ValueError)
