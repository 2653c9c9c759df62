"""JSON found inside strings (client fields, model output), parsed with a depth limit.

A JSON document nested thousands of levels deep inside a string (a schema given as text, a
tool call's ``arguments``, model output) makes ``json.loads`` raise ``RecursionError``,
which is no ``ValueError`` and so escaped every handler as a 500. :func:`loads_limited`
measures the nesting first, in linear time without recursion, and raises ``ValueError`` (a
``json.JSONDecodeError`` for malformed text, as ``json.loads`` does) for anything it will
not parse (a ``MemoryError`` while parsing included). Knows nothing about HTTP.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # as for request bodies (openai_api.MAX_JSON_DEPTH)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # one alternative per character: linear
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings (malformed text gets an
    estimate; ``json.loads`` rejects it anyway)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def loads_limited(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, but ``ValueError`` for nesting deeper than ``max_depth`` and for
    text too large to parse in the memory left (a ``MemoryError``: the text's fault, not ours)."""
    try:
        depth = nesting_depth(text)
        if depth > max_depth:
            raise ValueError(f"JSON nested {depth} levels deep (at most {max_depth})")
        return json.loads(text)
    except RecursionError:  # cannot happen below the limit; kept so no caller ever sees it
        raise ValueError(f"JSON nested too deeply (at most {max_depth} levels)") from None
    except MemoryError:
        raise ValueError(f"JSON of {len(text)} characters is too large to parse in the memory left") from None
