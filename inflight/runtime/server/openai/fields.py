"""Reading the fields of an OpenAI request body: one reader per JSON type, the one table of
fields this server refuses unless they say "off" and the one of those it accepts as harmless.

Each reader returns ``None`` when the field is absent or null (the caller, or
``SamplingParams``' own default, decides what that means: no default is typed twice) and
raises a 400 naming the field when it has the wrong type or is out of the bounds given. A field
nested in another (``tools[2].function.name``) is read with ``param``, the top-level field the
400 names, and ``at``, its path as the message shows it. The error messages read the same
whichever part of the request parses the field. Knows nothing about what the fields mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inflight.runtime.sampling_params import brief
from inflight.runtime.server.errors import bad_request

# Fields that would change the output and are not implemented: refused unless "off" (a
# request that uses them is refused rather than silently answered differently).
UNSUPPORTED_UNLESS_OFF: dict[str, tuple[object, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,),
    "documents": (None, []),
    "chat_template": (None,),
    # vLLM's sampling extras we do not implement (beam search is refused, so length_penalty
    # could only be 1; spaces_between_special_tokens only matters with skip_special_tokens off).
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "structural_tag": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "include_reasoning": (None, True),
    "prompt_embeds": (None,),
    "verbosity": (None,),
}
# Accepted as harmless (they do not change what the model writes): user (divides its caller's
# share under the fair policy) and the bookkeeping fields below. cache_salt is honoured (it
# seeds the request's block hashes). Any field in neither table nor read by a parser is unknown
# (``known_fields``): logged and named in a response header, or refused with
# --reject-unknown-fields.
ACCEPTED_HARMLESS: frozenset[str] = frozenset((
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "guided_decoding_backend",
    "request_id", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
))


def refuse_unsupported(obj: dict[str, Any]) -> None:
    """400 naming the first field of :data:`UNSUPPORTED_UNLESS_OFF` that ``obj`` turns on."""
    for name, off in UNSUPPORTED_UNLESS_OFF.items():
        if obj.get(name) is not None and obj[name] not in off:
            raise bad_request(f"'{name}' is not supported by this server; leave it out", name)


def get_int(obj: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None,
            param: str | None = None, at: str | None = None) -> int | None:
    """An integer field within ``[minimum, maximum]`` (either end open when ``None``)."""
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{at or name}' must be an integer (got {brief(value)})", param or name)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise bad_request(f"'{at or name}' must be {bounds(minimum, maximum)} (got {brief(value)})", param or name)
    return value


def bounds(minimum: int | None, maximum: int | None) -> str:
    """``>= a``, ``<= b`` or ``between a and b``."""
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"between {minimum} and {maximum}"


def get_number(obj: dict[str, Any], name: str) -> float | None:
    """A number field (an integer is taken as a float)."""
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number (got {brief(value)})", name)
    try:
        return float(value)
    except OverflowError:  # an integer literal too large for a float
        raise bad_request(f"'{name}' is out of range (got {brief(value)})", name) from None


def get_bool(obj: dict[str, Any], name: str, param: str | None = None, at: str | None = None) -> bool | None:
    """A boolean field."""
    return _typed(obj, name, bool, "true or false", param, at)


def get_str(obj: dict[str, Any], name: str, param: str | None = None, at: str | None = None) -> str | None:
    """A string field."""
    return _typed(obj, name, str, "a string", param, at)


def get_object(obj: dict[str, Any], name: str, param: str | None = None, at: str | None = None) -> dict[str, Any] | None:
    """An object field (a JSON object: a dict)."""
    return _typed(obj, name, dict, "an object", param, at)


def get_list(obj: dict[str, Any], name: str, max_len: int | None = None, param: str | None = None,
             at: str | None = None) -> list[Any] | None:
    """A list field of at most ``max_len`` entries (``None``: no bound here)."""
    value: list[Any] | None = _typed(obj, name, list, "a list", param, at)
    if value is not None and max_len is not None and len(value) > max_len:
        raise bad_request(f"'{at or name}' may hold at most {max_len} entries (got {len(value)})", param or name)
    return value


def _typed(obj: dict[str, Any], name: str, kind: type, noun: str, param: str | None, at: str | None) -> Any:
    """``obj[name]`` when it is a ``kind`` (``None`` when absent or null), else a 400 saying it
    must be ``noun``."""
    value = obj.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"'{at or name}' must be {noun} (got {brief(value)})", param or name)
    return value


# The sampling fields read straight into SamplingParams (those a request leaves out keep its
# defaults); max_tokens, stop, stop_token_ids, logit_bias and the logprob counts are read apart.
SAMPLING_READERS: dict[str, Callable[[dict[str, Any], str], object]] = {
    "temperature": get_number, "top_p": get_number, "min_p": get_number,
    "presence_penalty": get_number, "frequency_penalty": get_number, "repetition_penalty": get_number,
    "top_k": lambda obj, name: get_int(obj, name, -1), "seed": get_int,
    "min_tokens": lambda obj, name: get_int(obj, name, 0), "ignore_eos": get_bool,
    "skip_special_tokens": get_bool,
}
