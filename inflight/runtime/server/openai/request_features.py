"""Parse the request fields that shape *what* a chat or completion says, beyond sampling.

``response_format`` (json_object / json_schema), vLLM's ``guided_*`` and ``structured_outputs``,
``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``chat_template_kwargs``, the template
flags (``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``),
``logit_bias``, ``echo``, ``best_of`` and ``prompt_logprobs`` become one frozen
:class:`RequestFeatures`. At most one output constraint per request; forced tool calls
(``required`` or a named function) become a JSON-schema constraint so their arguments always
parse and validate. Which fields are refused unless off or accepted as harmless is ``fields``';
which are unknown at all (logged, or refused), ``known_fields``'. The tools themselves (``tools``, ``tool_choice``, forced-call
schemas, tool calls in a history) are ``tool_requests``'. Knows nothing about tokenizers or the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.runtime.sampling_params import brief
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai import tool_requests
from inflight.runtime.server.openai.fields import get_bool, get_int, get_object
from inflight.runtime.structured import StructuredOutputsParams

MAX_LOGIT_BIAS = 1024
# apply_chat_template's own arguments: a client must not set them through chat_template_kwargs.
_TEMPLATE_RESERVED = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    structured: StructuredOutputsParams | None = None
    constraint_param: str | None = None  # the field the constraint came from (for errors)
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool objects, for the chat template
    tool_choice: str = "none"  # none | auto | required | named
    tool_name: str | None = None  # the named function
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    logit_bias: tuple[tuple[int, float], ...] = ()
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_generation_prompt: bool = True  # chat: end the prompt with the assistant's header
    continue_final_message: bool = False  # chat: leave the final (assistant) message open
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions true, chat false)
    client_n: int | None = None  # set when best_of > n expands the request to best_of candidates
    wants_logprobs: bool = False  # ... and whether the client itself asked for logprobs


def parse_features(obj: dict[str, Any], is_chat: bool, n: int, max_logprobs: int | None) -> RequestFeatures:
    """Validate the output-shaping fields of a request body (400 naming the field on error);
    ``max_logprobs``: the server's ceiling on ``prompt_logprobs`` (``None``: none)."""
    tools, choice, tool_name, parallel = tool_requests.parse_tools(obj) if is_chat else ((), "none", None, True)
    if not is_chat:
        for name in ("tools", "tool_choice", "response_format", "chat_template_kwargs"):
            if obj.get(name) is not None:
                raise bad_request(f"'{name}' is only for /v1/chat/completions", name)
    constraints = _parse_constraints(obj)
    if choice in ("required", "named"):
        schema = tool_requests.forced_tool_schema(tools, choice, tool_name, parallel)
        constraints.append(_constraint("tool_choice", StructuredOutputsParams.json_schema, schema))
    if len(constraints) > 1:
        names = ", ".join(f"'{p}'" for p, _ in constraints)
        raise bad_request(f"only one output constraint per request; got {names}", constraints[1][0])
    param, structured = constraints[0] if constraints else (None, None)
    add_generation_prompt, continue_final = _parse_template_flags(obj) if is_chat else (True, False)
    return RequestFeatures(
        structured=structured, constraint_param=param, tools=tools, tool_choice=choice, tool_name=tool_name,
        parallel_tool_calls=parallel, chat_template_kwargs=_parse_template_kwargs(obj) if is_chat else {},
        logit_bias=_parse_logit_bias(obj.get("logit_bias")), echo=_parse_echo(obj, is_chat),
        best_of=_parse_best_of(obj, is_chat, n), prompt_logprobs=_parse_prompt_logprobs(obj, max_logprobs),
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        add_special_tokens=get_bool(obj, "add_special_tokens"),
    )


def _parse_template_flags(obj: dict[str, Any]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message), as vLLM takes them: both true is a 400;
    ``add_generation_prompt`` defaults to true, or to false when the final message is continued."""
    continue_final = get_bool(obj, "continue_final_message") or False
    add_generation_prompt = get_bool(obj, "add_generation_prompt")
    if continue_final and add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    return (not continue_final if add_generation_prompt is None else add_generation_prompt), continue_final


def _parse_prompt_logprobs(obj: dict[str, Any], max_logprobs: int | None) -> int | None:
    value = logprobs_count(obj, "prompt_logprobs", max_logprobs)
    if value is not None and obj.get("stream"):
        raise bad_request("'prompt_logprobs' cannot be streamed here; send the request without 'stream'",
                          "prompt_logprobs")
    return value


def logprobs_count(obj: dict[str, Any], name: str, max_logprobs: int | None) -> int | None:
    """A count of alternatives (``logprobs``, ``top_logprobs``, ``prompt_logprobs``): an integer
    from 0 to the server's ``--max-logprobs`` (``None``: no ceiling here; the engine still checks
    it against the vocabulary)."""
    value = get_int(obj, name, 0)
    if value is not None and max_logprobs is not None and value > max_logprobs:
        raise bad_request(f"'{name}' must be between 0 and {max_logprobs} (got {brief(value)}); "
                          f"{max_logprobs} is this server's --max-logprobs", name)
    return value


def _parse_echo(obj: dict[str, Any], is_chat: bool) -> bool:
    value = get_bool(obj, "echo")
    if value is None:
        return False
    if value and obj.get("stream") and not is_chat:
        raise bad_request("'echo' cannot be streamed here; send the request without 'stream'", "echo")
    return value


def _parse_best_of(obj: dict[str, Any], is_chat: bool, n: int) -> int | None:
    best_of = get_int(obj, "best_of", 1, 16)
    if best_of is None:
        return None
    if is_chat:
        raise bad_request("'best_of' is only supported on /v1/completions", "best_of")
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of > n and obj.get("stream"):
        raise bad_request("'best_of' larger than 'n' cannot be streamed", "best_of")
    return best_of


def _parse_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' keys must be token ids (got {key!r})", "logit_bias") from None
        if token < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' needs token ids >= 0 and biases in [-100, 100] (got {key!r}: {bias!r})",
                              "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _parse_template_kwargs(obj: dict[str, Any]) -> dict[str, Any]:
    value = get_object(obj, "chat_template_kwargs")
    if value is None:
        return {}
    reserved = set(_TEMPLATE_RESERVED) & set(value)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' must not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    return dict(value)


def _constraint(param: str, make: Any, value: Any) -> tuple[str, StructuredOutputsParams]:
    try:
        return param, make(value)
    except ValueError as exc:
        raise bad_request(f"'{param}': {exc}", param) from None


def _parse_constraints(obj: dict[str, Any]) -> list[tuple[str, StructuredOutputsParams]]:
    found = []
    rf = obj.get("response_format")
    if rf is not None:
        parsed = _parse_response_format(rf)
        if parsed is not None:
            found.append(("response_format", parsed))
    S = StructuredOutputsParams
    guided = {"guided_json": S.json_schema, "guided_regex": S.regex, "guided_choice": S.choice,
              "guided_grammar": S.grammar}
    for name, make in guided.items():
        if obj.get(name) is not None:
            found.append(_constraint(name, make, obj[name]))
    so = get_object(obj, "structured_outputs")
    if so is not None:
        makers = {"json": S.json_schema, "regex": S.regex, "choice": S.choice, "grammar": S.grammar}
        unknown = sorted(set(so) - set(makers) - {"json_object"})
        if unknown:
            raise bad_request(f"'structured_outputs' does not support {', '.join(unknown)}", "structured_outputs")
        for key, make in makers.items():
            if so.get(key) is not None:
                found.append(_constraint("structured_outputs", make, so[key]))
        if so.get("json_object"):
            found.append(("structured_outputs", S.json_object()))
    return found


def _parse_response_format(rf: object) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams.json_object()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema' object",
                              "response_format")
        if not isinstance(spec.get("name", "x"), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise bad_request("'response_format.json_schema' needs a string 'name' and a boolean 'strict'",
                              "response_format")
        return _constraint("response_format", StructuredOutputsParams.json_schema, spec.get("schema", {}))[1]
    raise bad_request(f"'response_format.type' must be text, json_object or json_schema (got {kind!r})",
                      "response_format")


def engine_prompt_logprobs(features: RequestFeatures, num_logprobs: int | None, is_chat: bool) -> int | None:
    """How many prompt alternatives the engine must compute: ``prompt_logprobs``, or for a
    completion's ``echo`` with ``logprobs`` the same number as for the output tokens (a chat's
    echo repeats the final message's text only)."""
    echoed = num_logprobs if features.echo and not is_chat else None
    wanted = [k for k in (features.prompt_logprobs, echoed) if k is not None]
    return max(wanted) if wanted else None
