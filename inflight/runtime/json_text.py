"""JSON found inside strings (client fields, model output), parsed with a depth limit.

A JSON document nested thousands of levels deep inside a string (a schema given as text, a
tool call's ``arguments``, model output) makes ``json.loads`` raise ``RecursionError``,
which is no ``ValueError`` and so escaped every handler as a 500. :func:`loads_limited`
measures the nesting first and raises ``ValueError`` (a ``json.JSONDecodeError`` for
malformed text, as ``json.loads`` does) for anything it will not parse (a ``MemoryError``
while parsing included). Knows nothing about HTTP.

The measure is one left-to-right scan (:func:`depth_scan`), linear in the text whatever it
holds: its one pattern has fixed-width alternatives only, so the regex engine does constant
work at each position and never retries from an earlier one, and each match is one step of a
Python loop (which also lets other threads, the event loop among them, run between steps). The
scan it replaced stripped strings with ``"(?:[^"\\\\]|\\\\.)*"`` first: an unterminated string
made that pattern run to the end of the text from *every* quote, so ``"`` plus 64k copies of
``\\"`` took 47 s in one C call holding the GIL (issue 46).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # as for request bodies (openai_api.MAX_JSON_DEPTH)
# An escape (a backslash and the character after it), a quote or a bracket: 1 or 2 characters,
# no repetition, so matching at any one position costs the engine a constant.
TOKEN = re.compile(r'\\.|["\[\]{}]', re.DOTALL)


@dataclass(frozen=True, slots=True)
class DepthScan:
    """What :func:`depth_scan` found. ``depth``: the deepest bracket nesting outside strings
    (``stop_above + 1`` when the scan stopped early). ``num_steps``: the matches the scan
    handled, at most one per character of the text (the work, for tests that prove it linear)."""

    depth: int
    num_steps: int


def depth_scan(text: str, stop_above: int | None = None) -> DepthScan:
    """Bracket nesting of ``text`` outside JSON strings, in one linear scan that stops as soon
    as the depth passes ``stop_above``. Strings are what ``json.loads`` reads as strings: an
    unterminated one runs to the end, and a closing bracket at depth 0 is ignored (malformed
    text gets an estimate; ``json.loads`` rejects it before it could nest deeper)."""
    depth = deepest = num_steps = 0
    in_string = False
    for match in TOKEN.finditer(text):
        num_steps += 1
        char = match[0]
        if in_string:  # an escape or a bracket stays inside; a lone quote ends it
            in_string = char != '"'
            continue
        char = char[-1]  # outside a string a backslash escapes nothing: what follows it counts
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    break
        elif char in "]}" and depth:
            depth -= 1
    return DepthScan(deepest, num_steps)


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings (malformed text gets an
    estimate; ``json.loads`` rejects it anyway)."""
    return depth_scan(text).depth


def too_deep(text: str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether ``text`` nests brackets deeper than ``max_depth`` outside strings (text with
    no more opening brackets than that cannot, and is not scanned at all)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    return depth_scan(text, max_depth).depth > max_depth


def loads_limited(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, but ``ValueError`` for nesting deeper than ``max_depth`` and for
    text too large to parse in the memory left (a ``MemoryError``: the text's fault, not ours)."""
    try:
        if too_deep(text, max_depth):
            raise ValueError(f"JSON nested more than {max_depth} levels deep (at most {max_depth} allowed)")
        return json.loads(text)
    except RecursionError:  # cannot happen below the limit; kept so no caller ever sees it
        raise ValueError(f"JSON nested too deeply (at most {max_depth} levels)") from None
    except MemoryError:
        raise ValueError(f"JSON of {len(text)} characters is too large to parse in the memory left") from None
