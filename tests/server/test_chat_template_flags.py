"""vLLM's chat-template flags on /v1/chat/completions and /tokenize: ``add_generation_prompt``,
``continue_final_message`` (the reply continues the final assistant message, left open),
``add_special_tokens`` and chat ``echo``, each prompt compared with transformers' own
``apply_chat_template``; the output-changing fields still unimplemented are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.protocol import parse_chat_request, parse_completion_request
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

PREFIX = "Autumn leaves drift"
CONTINUE = [{"role": "user", "content": "Write a haiku about the sea."}, {"role": "assistant", "content": PREFIX}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
GREEDY = dict(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def hf_tokenizer(demo_model_dir: Path) -> Any:
    """The model directory's tokenizer loaded by transformers itself: the reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(demo_model_dir))


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _hf_ids(tok: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _tokenize(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    reply = http("POST", f"{server.url}/tokenize", {"model": MODEL_NAME, **body})
    assert reply.status == 200, reply.text
    return reply.json()


@pytest.mark.parametrize(("messages", "fields", "reference"), [
    (CONTINUE, {"continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True}),
    (CONTINUE, {"continue_final_message": True}, {"continue_final_message": True}),  # vLLM clients send both
    (ASK, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
    (ASK, {}, {"add_generation_prompt": True}),
], ids=["continue", "continue-alone", "no-generation-prompt", "default"])
def test_tokenize_renders_as_transformers(server: LiveServer, hf_tokenizer: Any, messages: list, fields: dict,
                                          reference: dict) -> None:
    got = _tokenize(server, {"messages": messages, **fields})
    want = _hf_ids(hf_tokenizer, messages, **reference)
    assert got["tokens"] == want and got["count"] == len(want)
    if reference.get("continue_final_message"):
        assert hf_tokenizer.decode(got["tokens"]).endswith(PREFIX)  # open: no end-of-turn after it


def test_continue_final_message_continues_the_assistant_text(client: openai.OpenAI, hf_tokenizer: Any) -> None:
    """The chat reply is exactly what the model writes after transformers' open-ended prompt."""
    ids = _hf_ids(hf_tokenizer, CONTINUE, continue_final_message=True)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, **GREEDY,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == plain.choices[0].text
    closed = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, **GREEDY)
    assert closed.usage.prompt_tokens == len(_hf_ids(hf_tokenizer, CONTINUE, add_generation_prompt=True))


def test_chat_without_the_generation_prompt(client: openai.OpenAI, hf_tokenizer: Any) -> None:
    ids = _hf_ids(hf_tokenizer, ASK, add_generation_prompt=False)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=ASK, **GREEDY,
                                          extra_body={"add_generation_prompt": False})
    plain = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == plain.choices[0].text


def test_chat_echo_puts_the_continued_text_first(client: openai.OpenAI) -> None:
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, **GREEDY, extra_body=flags)
    echoed = client.chat.completions.create(model=MODEL_NAME, messages=CONTINUE, **GREEDY,
                                            extra_body={**flags, "echo": True})
    assert echoed.choices[0].message.content == PREFIX + plain.choices[0].message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    deltas = [chunk.choices[0].delta.content for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=CONTINUE, stream=True, **GREEDY, extra_body={**flags, "echo": True})
        if chunk.choices and chunk.choices[0].delta.content]
    assert deltas[0] == PREFIX and "".join(deltas) == echoed.choices[0].message.content
    no_echo = client.chat.completions.create(model=MODEL_NAME, messages=ASK, **GREEDY, extra_body={"echo": True})
    asked = client.chat.completions.create(model=MODEL_NAME, messages=ASK, **GREEDY)
    assert no_echo.choices[0].message.content == asked.choices[0].message.content  # last message is the user's


def test_add_special_tokens(server: LiveServer, client: openai.OpenAI, hf_tokenizer: Any) -> None:
    text = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    with_bos = hf_tokenizer.encode(text, add_special_tokens=True)
    assert with_bos != _hf_ids(hf_tokenizer, ASK, add_generation_prompt=True)  # the demo tokenizer adds a BOS
    assert _tokenize(server, {"messages": ASK, "add_special_tokens": True})["tokens"] == with_bos
    chat = client.chat.completions.create(model=MODEL_NAME, messages=ASK, **GREEDY,
                                          extra_body={"add_special_tokens": True})
    assert chat.usage.prompt_tokens == len(with_bos)
    bare = client.completions.create(model=MODEL_NAME, prompt="def f(x):", **GREEDY,
                                     extra_body={"add_special_tokens": False})
    assert bare.usage.prompt_tokens == len(hf_tokenizer.encode("def f(x):", add_special_tokens=False))


def test_return_token_strs(server: LiveServer, hf_tokenizer: Any) -> None:
    got = _tokenize(server, {"prompt": "def add(a, b):", "return_token_strs": True})
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])  # vLLM's spelling
    chat = _tokenize(server, {"messages": CONTINUE, "continue_final_message": True, "return_token_strs": True})
    assert chat["token_strs"] == hf_tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert _tokenize(server, {"prompt": "def add(a, b):"})["token_strs"] is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(("messages", "fields", "needle"), [
    (CONTINUE, {"continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
    (ASK, {"continue_final_message": True, "add_generation_prompt": False}, "must be the assistant's"),
    (CONTINUE, {"continue_final_message": "yes"}, "true or false"),
], ids=["both", "last-is-user", "not-bool"])
def test_template_flag_refusals(server: LiveServer, path: str, messages: list, fields: dict, needle: str) -> None:
    reply = http("POST", server.url + path, {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **fields})
    error = reply.json()["error"]
    assert reply.status == 400 and error["param"] == "continue_final_message" and needle in error["message"]


REFUSED = {
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "logits_processors": ["pkg.Proc"], "structural_tag": "{}",
    "return_tokens_as_token_ids": True, "return_token_ids": True, "include_reasoning": False,
    "length_penalty": 2.0, "spaces_between_special_tokens": False, "verbosity": "low",
}
ACCEPTED = {
    "allowed_token_ids": None, "bad_words": [], "logits_processors": [], "return_tokens_as_token_ids": False,
    "return_token_ids": False, "include_reasoning": True, "length_penalty": 1.0, "spaces_between_special_tokens": True,
    "echo": True, "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
    "cache_salt": "abc", "vllm_xargs": {"k": 1}, "mm_processor_kwargs": {},
}


@pytest.mark.parametrize(("name", "value"), list(REFUSED.items()), ids=list(REFUSED))
def test_unimplemented_output_fields_are_refused_by_name(name: str, value: object) -> None:
    for parse, body in ((parse_chat_request, {"messages": ASK}), (parse_completion_request, {"prompt": "x"})):
        with pytest.raises(APIError) as info:
            parse({**body, name: value})
        assert info.value.status == 400 and info.value.param == name


def test_off_values_and_bookkeeping_are_accepted() -> None:
    req = parse_chat_request({"messages": CONTINUE, **ACCEPTED})
    assert req.features.echo and req.echo_text == PREFIX and req.params.prompt_logprobs is None
    parse_completion_request({"prompt": "x", **{k: v for k, v in ACCEPTED.items() if k != "echo"}})


def test_models_retrieve(server: LiveServer, client: openai.OpenAI) -> None:
    listed = client.models.list().data[0]
    card = client.models.retrieve(MODEL_NAME)
    assert (card.id, card.object, card.owned_by) == (listed.id, "model", listed.owned_by)
    assert card.model_extra["max_model_len"] == listed.model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other-model")
    assert info.value.body["code"] == "model_not_found"
    reply = http("GET", f"{server.url}/v1/models/{MODEL_NAME}/extra")  # a slash is part of the id
    assert reply.status == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_models_retrieve_a_name_with_a_slash(demo_model_dir: Path) -> None:
    """Hub-style names (``org/name``): the openai client percent-encodes the slash."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.server import ServerSettings

    name = "org/demo-model"
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=16, max_model_len=128),
                      ServerSettings(model_name=name)).start()
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.retrieve(name).id == name
        assert http("GET", f"{live.url}/v1/models/{name}").json()["id"] == name  # sent raw, as curl does
    finally:
        live.stop()
