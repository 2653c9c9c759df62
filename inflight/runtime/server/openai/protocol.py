"""Parse and validate OpenAI request bodies into what the engine takes.

Owns the request side of the OpenAI API: which fields exist, their types and bounds, and
the translation into ``SamplingParams`` plus prompts (text or token ids) or chat messages.
Every problem becomes a 400 ``APIError`` whose ``param`` names the offending field. The
server's :class:`RequestPolicy` fills the sampling fields a request leaves out (vLLM's
``--generation-config``) and caps the logprobs it may ask for (``--max-logprobs``).
Knows nothing about tokenizers, the engine or HTTP transport: the handlers encode prompts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inflight.runtime.core.input_checks import check_cache_salt
from inflight.runtime.generation_defaults import SamplingDefaults
from inflight.runtime.multimodal.inputs import MultimodalInputs
from inflight.runtime.multimodal.media import IMAGE_SLOT, MediaError, image_url_of
from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.sampling_params import MAX_STOP_STRINGS, SamplingParams, brief
from inflight.runtime.server.errors import APIError, bad_request
from inflight.runtime.server.openai.fields import SAMPLING_READERS, get_bool, get_int, get_str, refuse_unsupported
from inflight.runtime.server.openai.known_fields import CHAT_SHAPE, COMPLETION_SHAPE, check_known
from inflight.runtime.server.openai.request_features import (
    RequestFeatures,
    engine_prompt_logprobs,
    logprobs_count,
    parse_features,
)
from inflight.runtime.server.openai.tool_requests import chat_message

MAX_N = 16
MAX_PROMPTS = 64
# OpenAI's default for completions: SamplingParams' own default
DEFAULT_COMPLETION_MAX_TOKENS = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """What the server fills in and allows: ``defaults`` for the sampling fields a request leaves
    out (a field the request sets always wins), and ``max_logprobs``, the most ``logprobs`` /
    ``top_logprobs`` / ``prompt_logprobs`` a request may ask for (``None``: no ceiling but the
    model's vocabulary). ``reject_unknown_fields``: a field no parser knows is a 400
    (``--reject-unknown-fields``) instead of being ignored and named in ``ignored_fields``."""

    defaults: SamplingDefaults = SamplingDefaults()
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS
    reject_unknown_fields: bool = False


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request.

    ``prompts`` holds the completion prompts (text or token ids); ``messages`` the chat
    messages (``None`` for completions). ``num_logprobs`` is how many alternatives to report
    per token (``None``: no logprobs). ``max_tokens_given`` is false when the client left the
    output length to the server (chat), which then fills the rest of the context.
    ``ignored_fields``: the fields of the body this server does not know (dotted paths), which
    it ignored (``known_fields``).
    """

    model: str | None
    is_chat: bool
    prompts: tuple[Prompt, ...]
    messages: tuple[dict[str, str], ...] | None
    params: SamplingParams
    max_tokens_given: bool
    n: int
    stream: bool
    include_usage: bool
    num_logprobs: int | None
    priority: int
    user: str | None
    features: RequestFeatures = dataclasses.field(default_factory=RequestFeatures)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    ignored_fields: tuple[str, ...] = ()
    lora_name: str | None = None  # the LoRA adapter ``model`` names (set by api.py once resolved)
    # chat image_url parts, in order (each is IMAGE_SLOT in its message's text: chat_images.py)
    image_urls: tuple[str, ...] = ()
    mm_inputs: MultimodalInputs | None = None  # the images as the engine takes them (set by chat_images.py)

    def params_for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of ``n``: a request seed becomes ``seed + index`` so choices differ."""
        if self.params.seed is None or index == 0:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index)

    @property
    def echo_text(self) -> str:
        """A chat ``echo``: the final message's text when it is the assistant's (vLLM repeats
        the last message when it has the reply's role), put in front of every choice."""
        if not (self.is_chat and self.features.echo and self.messages):
            return ""
        last = self.messages[-1]
        return (last.get("content") or "") if last["role"] == "assistant" else ""


def parse_completion_request(body: object, policy: RequestPolicy = RequestPolicy()) -> GenerationRequest:
    """Validate a /v1/completions body."""
    obj = _require_object(body)
    prompts = _parse_prompt(obj.get("prompt"))
    num_logprobs = logprobs_count(obj, "logprobs", policy.max_logprobs)
    return _build(obj, is_chat=False, prompts=prompts, messages=None, num_logprobs=num_logprobs, policy=policy)


def parse_chat_request(body: object, policy: RequestPolicy = RequestPolicy()) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    obj = _require_object(body)
    messages, image_urls = _parse_messages(obj.get("messages"))
    want_logprobs = bool(get_bool(obj, "logprobs"))
    top = logprobs_count(obj, "top_logprobs", policy.max_logprobs)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    num_logprobs = (top or 0) if want_logprobs else None
    req = _build(obj, is_chat=True, prompts=(), messages=messages, num_logprobs=num_logprobs, policy=policy)
    req = dataclasses.replace(req, image_urls=image_urls) if image_urls else req
    if req.features.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' continues the final message, which must be the assistant's "
                          f"(the reply to continue); the last message is the {messages[-1]['role']}'s",
                          "continue_final_message")
    return req


def _build(
    obj: dict[str, Any],
    *,
    is_chat: bool,
    prompts: tuple[Prompt, ...],
    messages: tuple[dict[str, str], ...] | None,
    num_logprobs: int | None,
    policy: RequestPolicy,
) -> GenerationRequest:
    ignored = check_known(obj, CHAT_SHAPE if is_chat else COMPLETION_SHAPE, reject=policy.reject_unknown_fields)
    refuse_unsupported(obj)
    model = get_str(obj, "model")
    stream = bool(get_bool(obj, "stream"))
    include_usage = _parse_stream_options(obj.get("stream_options"), stream)
    n = get_int(obj, "n", 1, MAX_N) or 1
    features = parse_features(obj, is_chat, n, policy.max_logprobs)
    max_tokens_param, max_tokens = _parse_max_tokens(obj, is_chat)
    params = _sampling_params(_with_defaults(obj, policy.defaults), max_tokens, num_logprobs, max_tokens_param,
                              features, is_chat)
    return GenerationRequest(
        model=model,
        is_chat=is_chat,
        prompts=prompts,
        messages=messages,
        params=params,
        max_tokens_given=max_tokens is not None,
        n=n,
        stream=stream,
        include_usage=include_usage,
        num_logprobs=num_logprobs,
        priority=get_int(obj, "priority", -(2**31), 2**31 - 1) or 0,
        user=get_str(obj, "user"),
        features=features,
        cache_salt=_parse_cache_salt(obj),
        ignored_fields=ignored,
    )


def _sampling_params(
    obj: dict[str, Any], max_tokens: int | None, num_logprobs: int | None, max_tokens_param: str,
    features: RequestFeatures, is_chat: bool,
) -> SamplingParams:
    """The request's one ``SamplingParams``, validated once, by itself (a 400 naming the field
    its ``ParamError`` names: e.g. ``min_tokens`` beside a grammar)."""
    kwargs: dict[str, Any] = {name: value for name, read in SAMPLING_READERS.items()
                              if (value := read(obj, name)) is not None}  # the rest: SamplingParams' defaults
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if obj.get("stop") is not None:
        kwargs["stop"] = _parse_stop(obj["stop"])
    if obj.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = _parse_token_list(obj["stop_token_ids"], "stop_token_ids")
    kwargs.update(logprobs=num_logprobs, structured=features.structured, logit_bias=features.logit_bias,
                  prompt_logprobs=engine_prompt_logprobs(features, num_logprobs, is_chat))
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams' ParamError names its field
        field_name = getattr(exc, "field", None)
        param = max_tokens_param if field_name == "max_tokens" else field_name
        raise bad_request(str(exc), param if param in obj else None) from None


def _with_defaults(obj: dict[str, Any], defaults: SamplingDefaults) -> dict[str, Any]:
    """``obj`` with the server's default for each sampling field it leaves out (or sends as null)."""
    missing = {name: value for name, value in defaults.values().items() if obj.get(name) is None}
    return {**obj, **missing} if missing else obj


def _parse_cache_salt(obj: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string (bounded), or absent."""
    try:
        check_cache_salt(obj.get("cache_salt"))
    except RequestRejectedError as exc:
        raise bad_request(str(exc), "cache_salt") from None
    return obj.get("cache_salt")


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _parse_prompt(value: object) -> tuple[Prompt, ...]:
    if value is None:
        raise bad_request("'prompt' is required: a string, a list of strings or token ids", "prompt")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise bad_request(
            "'prompt' must be a string, a non-empty list of strings, a list of token ids "
            "or a list of token-id lists",
            "prompt",
        )
    if all(isinstance(v, str) for v in value):
        prompts: tuple[Prompt, ...] = tuple(value)
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        prompts = (_parse_token_list(value, "prompt"),)
    elif all(isinstance(v, list) for v in value):
        prompts = tuple(_parse_token_list(v, "prompt") for v in value)
    else:
        raise bad_request("'prompt' must not mix strings, token ids and lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)})", "prompt")
    return prompts


def _parse_token_list(value: object, param: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a list of token ids", param)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad_request(f"'{param}' token ids must be non-negative integers (got {brief(token)})", param)
    if param == "prompt" and not value:
        raise bad_request("a token-id prompt must not be empty", param)
    return tuple(value)


def _parse_messages(value: object) -> tuple[tuple[dict[str, str], ...], tuple[str, ...]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
    messages = []
    image_urls: list[str] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (got {brief(role)})", "messages"
            )
        messages.append(chat_message(message, i, _message_text(message.get("content"), i, image_urls)))
    return tuple(messages), tuple(image_urls)


def _message_text(content: object, index: int, image_urls: list[str]) -> str:
    """A message's text; each ``image_url`` part's URL goes to ``image_urls`` and its place in
    the text is :data:`IMAGE_SLOT` (chat_images.py puts the model's placeholder there)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                try:
                    image_urls.append(image_url_of(part, f"messages[{index}].content[{j}]"))
                except MediaError as exc:
                    raise bad_request(str(exc), exc.param) from None
                parts.append(IMAGE_SLOT)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': ...}} or "
                    "{'type': 'image_url', 'image_url': {'url': ...}}",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _parse_stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})", "stop")
    return tuple(stops)


def _parse_stream_options(value: object, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(value, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return bool(get_bool(value, "include_usage", param="stream_options"))


def _parse_max_tokens(obj: dict[str, Any], is_chat: bool) -> tuple[str, int | None]:
    name = "max_tokens"
    if is_chat and obj.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    return name, get_int(obj, name, 1)


def check_model(model: str | None, served: str) -> None:
    """404 ``model_not_found`` (as OpenAI and vLLM answer) unless ``model`` is the served name."""
    if model is not None and model != served:
        raise APIError(
            404,
            f"model '{model}' is not served here; this server serves '{served}' (see GET /v1/models)",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
