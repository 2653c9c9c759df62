"""The fields each endpoint knows, and what happens to the ones it does not: no field is ignored
in silence.

Owns the tables of known top-level fields of /v1/completions and /v1/chat/completions (what the
parsers read, plus :data:`~.fields.UNSUPPORTED_UNLESS_OFF` and :data:`~.fields.ACCEPTED_HARMLESS`)
and of the nested objects where a misspelling bites (``stream_options``, ``response_format``,
``tools[].function``, ``tool_choice``, ``messages[]`` and their ``tool_calls``); :func:`check_known`, which names a body's unknown fields
(dotted paths such as ``tools[0].function.paramters``) or, when the server refuses them
(``--reject-unknown-fields``), answers OpenAI's own 400 ``Unrecognized request argument
supplied: NAME``, with the near miss suggested. The HTTP side: :func:`record_ignored` leaves the
names on the aiohttp request, and :class:`IgnoredFieldLog` warns once per name per process; the
app's response hook puts them in the ``x-inflight-ignored-fields`` header.

Other endpoints (/v1/responses, /v1/messages) call :func:`check_known` with their own known set
and :func:`record_ignored` with what it returns. Knows nothing about what the fields mean.
"""

from __future__ import annotations

import difflib
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from aiohttp import web

from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.fields import ACCEPTED_HARMLESS, SAMPLING_READERS, UNSUPPORTED_UNLESS_OFF

IGNORED_FIELDS_HEADER = "x-inflight-ignored-fields"
IGNORED_FIELDS = web.RequestKey("inflight_ignored_fields", tuple)
MAX_HEADER_NAMES = 16  # names in the header (the rest counted: "... (+N more)")
MAX_NAME_CHARS = 64  # a name past this is cut in the header and the log
MAX_WARNED_NAMES = 1024  # distinct names one process warns about (a client can send any number)
SUGGEST_CUTOFF = 0.75  # difflib ratio a known name needs to be offered as the near miss


@dataclass(frozen=True, slots=True)
class Shape:
    """The known keys of a JSON object, and the known shapes of its object-valued keys
    (``items``: for a key holding a list of such objects)."""

    keys: frozenset[str]
    nested: Mapping[str, Shape] = field(default_factory=dict)
    items: Mapping[str, Shape] = field(default_factory=dict)


_SAMPLING = (*SAMPLING_READERS, "max_tokens", "stop", "stop_token_ids", "logit_bias")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
COMMON_FIELDS = frozenset((
    "model", "stream", "stream_options", "n", "priority", "user", "cache_salt", "prompt_logprobs",
    "add_special_tokens", "echo", "best_of", "response_format", "tools", "tool_choice", "chat_template_kwargs",
    *_SAMPLING, *_GUIDED, *UNSUPPORTED_UNLESS_OFF, *ACCEPTED_HARMLESS,
))  # response_format, tools, tool_choice, chat_template_kwargs, best_of: each endpoint says where they belong
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                               "parallel_tool_calls", "add_generation_prompt", "continue_final_message"}

_FUNCTION = Shape(frozenset(("name", "description", "parameters", "strict")))
_JSON_SCHEMA = Shape(frozenset(("name", "description", "schema", "strict")))
NESTED: dict[str, Shape] = {
    "stream_options": Shape(frozenset(("include_usage",))),
    "response_format": Shape(frozenset(("type", "json_schema")), nested={"json_schema": _JSON_SCHEMA}),
    "tool_choice": Shape(frozenset(("type", "function")), nested={"function": Shape(frozenset(("name",)))}),
}
# A chat message; replayed assistant messages carry what the API returned (refusal, annotations,
# audio, function_call, vLLM's reasoning fields), which is known here and ignored as OpenAI does.
_CALL = Shape(frozenset(("id", "type", "function", "index")),
              nested={"function": Shape(frozenset(("name", "arguments")))})
_MESSAGE = Shape(frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                            "reasoning", "refusal", "annotations", "audio", "function_call")),
                 items={"tool_calls": _CALL})
NESTED_ITEMS: dict[str, Shape] = {"tools": Shape(frozenset(("type", "function")), nested={"function": _FUNCTION}),
                                  "messages": _MESSAGE}
COMPLETION_SHAPE = Shape(COMPLETION_FIELDS, NESTED, NESTED_ITEMS)
CHAT_SHAPE = Shape(CHAT_FIELDS, NESTED, NESTED_ITEMS)


def check_known(obj: Mapping[str, Any], known: Iterable[str] | Shape, *, reject: bool) -> tuple[str, ...]:
    """The fields of ``obj`` that ``known`` (a set of top-level names, or a :class:`Shape` that
    also describes nested objects) does not name, as dotted paths in body order. With ``reject``
    a 400 in OpenAI's words instead, ``param`` the first such field, the nearest known name
    suggested. Values of the wrong type are not looked into (their parser names them)."""
    shape = known if isinstance(known, Shape) else Shape(frozenset(known))
    found: list[tuple[str, str, frozenset[str]]] = []  # (path, its last name, the names known there)
    _walk(obj, shape, "", found)
    if reject and found:
        raise refusal(found)
    return tuple(path for path, _, _ in found)


def _walk(obj: Mapping[str, Any], shape: Shape, prefix: str, found: list[tuple[str, str, frozenset[str]]]) -> None:
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if key not in shape.keys:
            found.append((path, key, shape.keys))
        elif key in shape.nested and isinstance(value, dict):
            _walk(value, shape.nested[key], path + ".", found)
        elif key in shape.items and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _walk(item, shape.items[key], f"{path}[{i}].", found)


def refusal(found: list[tuple[str, str, frozenset[str]]]) -> Any:
    """OpenAI's 400 for unrecognized arguments, with the near miss of each (``did you mean``)."""
    parts = []
    for path, name, known in found[:MAX_HEADER_NAMES]:
        near = suggestion(name, known)
        parts.append(_shown(path) + (f" (did you mean '{near}'?)" if near else ""))
    more = f" (+{len(found) - MAX_HEADER_NAMES} more)" if len(found) > MAX_HEADER_NAMES else ""
    noun = "argument" if len(found) == 1 else "arguments"
    return bad_request(f"Unrecognized request {noun} supplied: {', '.join(parts)}{more}", _shown(found[0][0]))


def suggestion(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` when it is a near miss (``max_token`` -> ``max_tokens``)."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=SUGGEST_CUTOFF)
    return close[0] if close else None


def _shown(name: str) -> str:
    """A client's field name made safe for a header or a log line: printable ASCII (the rest
    percent-encoded, as are commas and spaces), at most ``MAX_NAME_CHARS`` of it and "..."."""
    shown = quote(name[:MAX_NAME_CHARS + 1], safe="!\"#$&'()*+-./:;<=>?@[]^_`{|}~")
    if len(shown) <= MAX_NAME_CHARS:
        return shown
    return re.sub(r"%[0-9A-F]?$", "", shown[:MAX_NAME_CHARS]) + "..."  # no escape cut in half


def header_value(names: tuple[str, ...]) -> str:
    """The ``x-inflight-ignored-fields`` value: the names, comma-separated, bounded."""
    shown = ", ".join(_shown(n) for n in names[:MAX_HEADER_NAMES])
    return shown + (f" (+{len(names) - MAX_HEADER_NAMES} more)" if len(names) > MAX_HEADER_NAMES else "")


def record_ignored(request: web.Request, names: tuple[str, ...]) -> None:
    """Add ``names`` to the ignored fields left on ``request`` (an API that translates its body into
    a chat body records its own, then the chat parser its): the app's response hook names them in
    the ``x-inflight-ignored-fields`` header and logs each new name once."""
    if names:
        request[IGNORED_FIELDS] = tuple(dict.fromkeys((*request.get(IGNORED_FIELDS, ()), *names)))


class IgnoredFieldLog:
    """Warns once per ignored field name, for the life of the process (of the app), as vLLM
    warns about the fields it ignores; at most ``max_names`` distinct names, then one line
    saying that further names go unlogged (the header still names them)."""

    def __init__(self, logger: logging.Logger, max_names: int = MAX_WARNED_NAMES) -> None:
        self._logger = logger
        self._max_names = max_names
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._full = False

    def warn(self, names: Iterable[str], path: str) -> None:
        with self._lock:
            new = [n for n in dict.fromkeys(_shown(n) for n in names) if n not in self._seen]
            room = max(0, self._max_names - len(self._seen))
            fresh, dropped = new[:room], new[room:]
            self._seen.update(fresh)
            full_now = bool(dropped) and not self._full
            self._full = self._full or bool(dropped)
        if fresh:
            self._logger.warning("%s: ignored request field(s) this server does not know: %s (logged once per "
                                 "name; --reject-unknown-fields answers 400 instead)", path[:200], ", ".join(fresh))
        if full_now:
            self._logger.warning("%d distinct ignored field names logged; further ones are not (the %s header "
                                 "still names them)", self._max_names, IGNORED_FIELDS_HEADER)
