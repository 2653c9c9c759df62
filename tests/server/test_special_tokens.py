"""Special tokens in the output text: dropped by default, kept with ``skip_special_tokens: false``
(vLLM's field), and kept without being asked for when a chat output's parser reads markers that
the tokenizer makes special tokens (gpt-oss's harmony channels, Mistral's ``[TOOL_CALLS]``),
which the default detokenizing would drop before any parser saw them.

The demo tokenizer's ``<|im_start|>`` (id 3) is a special token that is not EOS: a ``logit_bias``
makes the model write it.
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from inflight.runtime.engine_core.detokenizer import IncrementalDetokenizer, stream_decoding
from inflight.runtime.server.openai.chat_output import ChatOutputPlan
from inflight.runtime.server.openai.chat_support import keeps_special_tokens
from tests.server.server_helpers import MODEL_NAME, http

IM_START = 3


def _complete(server, **fields) -> dict:
    reply = http("POST", f"{server.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0,
        "logit_bias": {str(IM_START): 100}, **fields})
    assert reply.status == 200, reply.text
    return reply.json()["choices"][0]


def test_special_tokens_dropped_by_default_kept_when_asked(server) -> None:
    assert _complete(server)["text"] == ""
    assert _complete(server, skip_special_tokens=True)["text"] == ""
    assert _complete(server, skip_special_tokens=False)["text"] == "<|im_start|>" * 3


def test_streamed_text_keeps_them_too(server) -> None:
    reply = http("POST", f"{server.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0, "stream": True,
        "logit_bias": {str(IM_START): 100}, "skip_special_tokens": False})
    assert reply.status == 200
    assert reply.text.count("<|im_start|>") == 3


def test_a_non_boolean_is_a_400_naming_the_field(server) -> None:
    reply = http("POST", f"{server.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": "hello", "max_tokens": 1, "skip_special_tokens": "no"})
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "skip_special_tokens"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(str(demo_model_dir))


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "python-window"])
def test_detokenizer_keeps_or_drops_as_told(tokenizer, stream: bool) -> None:
    ids = tokenizer.encode("a b", add_special_tokens=False)
    ids = [*ids[:1], IM_START, *ids[1:], IM_START]
    backend = stream_decoding(tokenizer) if stream else None
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, (), frozenset({tokenizer.eos_token_id}), backend, skip)
        for token_id in [*ids, tokenizer.eos_token_id]:
            detok.append(token_id)
        detok.flush()
        want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert detok.take_delta(True) == want
        assert ("<|im_start|>" in want) is (not skip)


@pytest.fixture(scope="module")
def harmony_tokenizer(demo_model_dir):
    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|end|>", "<|start|>"]})
    return tok


def test_a_plan_whose_markers_are_special_tokens_keeps_them(tokenizer, harmony_tokenizer) -> None:
    harmony = ChatOutputPlan(harmony=True)
    assert keeps_special_tokens(harmony, harmony_tokenizer)
    assert not keeps_special_tokens(harmony, tokenizer)  # the markers are plain text there
    hermes = ChatOutputPlan(tool_mode="hermes")
    assert not keeps_special_tokens(hermes, harmony_tokenizer)
    assert not keeps_special_tokens(ChatOutputPlan(), harmony_tokenizer)
    # a forced call's grammar writes plain JSON: no markers to keep
    assert not keeps_special_tokens(dataclasses.replace(harmony, tool_mode="required"), harmony_tokenizer)
