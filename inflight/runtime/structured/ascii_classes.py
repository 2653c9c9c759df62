"""ECMA-262's ``\\d``, ``\\w`` and ``\\s`` in the patterns of a constraint, written out before
llguidance compiles them.

llguidance reads regexes with Rust's ``regex-syntax``, where ``\\d`` is any Unicode decimal digit
(U+1FBF8 and some 760 others) and ``\\w`` any Unicode word character. JSON Schema patterns follow
ECMA-262 (``\\d`` = ``[0-9]``, ``\\w`` = ``[A-Za-z0-9_]``, ``\\s`` its fixed set of white space
and line terminators), and that is what users of ``guided_regex`` expect too (vLLM's default
grammar engine reads them so). :func:`ascii_classes` rewrites the six escapes, inside and
outside brackets, negated forms included, into explicit ranges; an escaped backslash (``\\\\d``)
and every other escape are left as written. :func:`schema_ascii_classes` does it for every
``pattern`` and ``patternProperties`` key of a JSON schema. Knows nothing about llguidance
itself.
"""

from __future__ import annotations

from typing import Any

MAX_CHAR = 0x10FFFF
# A class escape becomes up to ~90 times longer (``\\S``: ten ranges left out): past this many
# characters written out, a constraint is refused rather than handed to a compile that runs on
# in the background after its deadline.
MAX_WRITTEN_OUT_CHARS = 1 << 20
# ECMA-262 WhiteSpace and LineTerminator: TAB VT FF SP NBSP ZWNBSP, the Zs category, LF CR LS PS.
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
Ranges = tuple[tuple[int, int], ...]


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in ranges:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= MAX_CHAR:
        out.append((start, MAX_CHAR))
    return tuple(out)


def _items(ranges: Ranges) -> str:
    """``ranges`` as the inside of a bracket class, every end written ``\\x{..}``."""
    return "".join(f"\\x{{{low:X}}}" if low == high else f"\\x{{{low:X}}}-\\x{{{high:X}}}" for low, high in ranges)


_CLASSES: dict[str, str] = {
    "d": _items(_DIGIT), "D": _items(_complement(_DIGIT)),
    "w": _items(_WORD), "W": _items(_complement(_WORD)),
    "s": _items(_SPACE), "S": _items(_complement(_SPACE)),
}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d \\D \\w \\W \\s \\S`` as ECMA-262 reads them: ``[...]`` outside a
    bracket class, the same ranges spliced in inside one (``[^\\d]`` stays a negated class)."""
    if "\\" not in pattern:
        return pattern
    out: list[str] = []
    depth = 0  # bracket classes open (Rust's regex syntax nests them)
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\" and i + 1 < n:
            escaped = pattern[i + 1]
            if escaped in _CLASSES:
                out.append(_CLASSES[escaped] if depth else f"[{_CLASSES[escaped]}]")
            else:
                out.append(pattern[i:i + 2])  # \\ \[ \p ... as written (their tails are plain text)
            i += 2
            continue
        if char == "[" and depth and pattern.startswith("[:", i) and (close := pattern.find(":]", i + 2)) != -1:
            out.append(pattern[i:close + 2])  # a POSIX class ([:alpha:]) inside brackets: as written
            i = close + 2
            continue
        if char == "[":
            i = _open_class(pattern, i, out)
            depth += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        i += 1
    return bounded("".join(out))


def bounded(text: str) -> str:
    """``text`` (a rewritten pattern or schema) when at most :data:`MAX_WRITTEN_OUT_CHARS` long,
    else a ``ValueError`` saying so (the client's error: a 400)."""
    if len(text) > MAX_WRITTEN_OUT_CHARS:
        raise ValueError(f"it is {len(text)} characters long once its \\d, \\w and \\s classes are written out "
                         f"as ECMA-262 reads them; at most {MAX_WRITTEN_OUT_CHARS} are compiled (use fewer, or "
                         "quantifiers: \\d{8} for \\d\\d\\d\\d\\d\\d\\d\\d)")
    return text


def _open_class(pattern: str, i: int, out: list[str]) -> int:
    """Copy a class opening (``[``, ``[^``, and a ``]`` right after them, a literal there); the
    index after it."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    out.append(pattern[i:j])
    return j


def schema_ascii_classes(schema: Any) -> Any:
    """A copy of a JSON schema with :func:`ascii_classes` applied to every ``pattern`` string and
    ``patternProperties`` key, at any depth (values that are not schemas are copied as they are:
    a ``pattern`` key inside ``properties`` names a property and is left alone)."""
    if isinstance(schema, list):
        return [schema_ascii_classes(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_classes(k): schema_ascii_classes(v) for k, v in value.items()}
        elif key in _NAME_MAPS and isinstance(value, dict):
            out[key] = {k: schema_ascii_classes(v) for k, v in value.items()}
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # data, not schemas
        else:
            out[key] = schema_ascii_classes(value)
    return out


# Keys whose value maps names (never keywords) to schemas.
_NAME_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
