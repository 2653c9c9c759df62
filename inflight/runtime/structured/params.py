"""StructuredOutputsParams: one request's output constraint as a canonical, hashable value.

The value crosses from the server into ``SamplingParams`` and the engine, and is the key of
the compiled-grammar cache, so equal constraints written differently (whitespace of a JSON
schema sent as text) compile once. Key order is significant (fields are generated in it).
Once a manager has checked it, the value also carries its verdict, ``checked_grammar``: the
llguidance grammar text it passed as (:meth:`StructuredOutputsParams.checked`). The verdict
is no part of the key (equal constraints stay equal, checked or not); an engine given a
checked value only instantiates that grammar, without converting or checking it again.
Imports neither torch nor llguidance; validation of the grammar itself happens when it is
compiled (``manager``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from inflight.runtime.json_text import loads_limited

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024
# llguidance's Earley parser holds at most 2000 items per row, and a choice list puts every
# choice in one row: past this many, the first token would fail the matcher mid-generation.
MAX_CHOICES = 1000


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """``kind``: json (a JSON schema), json_object (any JSON object), regex, choice, grammar
    (Lark or GBNF). ``spec``: the schema as canonical JSON, the regex, the JSON list of
    choices, or the grammar text ("" for json_object). ``checked_grammar``: the verdict of a
    manager's check (``None`` until checked); set it with :meth:`checked` only."""

    kind: str
    spec: str = ""
    checked_grammar: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)} (got {self.kind!r}).")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string (got {type(self.spec).__name__}).")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters.")
        if self.checked_grammar is not None and not isinstance(self.checked_grammar, str):
            raise ValueError("a checked grammar must be the grammar's text.")

    def checked(self, grammar: str) -> StructuredOutputsParams:
        """This constraint with its verdict: ``grammar``, the llguidance grammar a manager
        built from it and checked (``StructuredOutputManager``'s compile)."""
        return replace(self, checked_grammar=grammar)

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutputsParams:
        """A JSON schema given as a dict/bool or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = loads_limited(schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not acceptable JSON: {str(exc)[:200]}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        # Key order is kept: it is the order the fields are generated in (as OpenAI does).
        return cls("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutputsParams:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputsParams:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex constraint must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Any) -> StructuredOutputsParams:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice constraint must be a non-empty list of non-empty strings")
        if len(set(choices)) > MAX_CHOICES:
            raise ValueError(f"a choice constraint may list at most {MAX_CHOICES} distinct choices "
                             f"(got {len(set(choices))}); a regex alternation holds more")
        return cls("choice", json.dumps(choices))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputsParams:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar constraint must be a non-empty Lark or GBNF grammar")
        return cls("grammar", text)
