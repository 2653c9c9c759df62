"""vLLM's ``serve`` flags in inflight's parser: aliases, notices, refusals and "did you mean".

Owns the argparse side of :mod:`vllm_flags`. An ``alias`` row becomes another spelling of the
inflight flag it names (visible in ``--help`` where the polarity is the same, hidden where it is
inverted, e.g. ``--disable-log-requests`` for ``--no-access-log``). Every other row becomes a
hidden flag that only records that it was given; :func:`check_given` then turns the record into
notices (one log line each) or the refusal to print. :func:`unknown_flags_message` answers a
flag nobody knows with the closest known one and a pointer to docs/from-vllm.md, and
:func:`normalize_argv` accepts ``--max_model_len`` for ``--max-model-len`` as vLLM does.
Knows nothing about serving.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any

from inflight.runtime.cli.vllm_flags import (
    ALIAS,
    FLAGS,
    NOTICE,
    ONLY,
    REFUSED,
    VALUE_ALIASES,
    VllmFlag,
    by_name,
)

GIVEN = "vllm_flags_given"  # namespace attribute: [(option string, values)] of recorded flags
DOC = "docs/from-vllm.md"
FLAG_SUGGEST_CUTOFF = 0.75  # difflib ratio of the names without dashes


def visible_aliases(flag: str) -> tuple[str, ...]:
    """vLLM's spellings of inflight's ``flag`` that mean the same (shown in ``--help``)."""
    names: list[str] = []
    for row in FLAGS:
        if row.kind == ALIAS and row.text == flag:
            names += [n for n in row.names if n != flag]
    return tuple(names)


def value_type(dest: str, base: Any = str) -> Any:
    """The flag's type, mapping vLLM's spellings of its values (``half`` -> ``float16``)."""
    mapping = VALUE_ALIASES.get(dest)
    if not mapping:
        return base

    def convert(text: str) -> Any:
        return base(mapping.get(text, text))

    convert.__name__ = getattr(base, "__name__", "value")
    return convert


class _Record(argparse.Action):
    """Remember that a vLLM flag was given (and its values), to be checked after parsing."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given = list(getattr(namespace, GIVEN, None) or [])
        given.append((option_string, values))
        setattr(namespace, GIVEN, given)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` every vLLM spelling not already on it (call after inflight's own flags)."""
    actions = {s: a for a in parser._actions for s in a.option_strings}
    for row in FLAGS:
        names = [n for n in (*row.names, row.negative) if n is not None and n not in actions]
        if not names:
            continue
        if row.kind == ALIAS:
            _add_alias(parser, row, actions, names)
        else:
            nargs = {0: 0, 1: None}.get(row.nargs, row.nargs)  # type: ignore[call-overload]
            parser.add_argument(*names, action=_Record, nargs=nargs, dest=GIVEN, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
        actions.update(dict.fromkeys(names))


def _add_alias(parser: argparse.ArgumentParser, row: VllmFlag, actions: dict[str, Any], names: list[str]) -> None:
    target = actions.get(row.text)
    if target is None:
        raise ValueError(f"vLLM alias {row.name} names {row.text}, which inflight serve does not have")
    hidden = dict(dest=target.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if target.nargs != 0:
        for name in names:
            parser.add_argument(name, type=target.type, choices=target.choices, nargs=target.nargs,
                                metavar=target.metavar, **hidden)
        return
    if isinstance(target, argparse.BooleanOptionalAction):
        const = not row.text.startswith("--no-")
    else:
        const = target.const
    for name in names:
        value = const if name in row.names else not const
        parser.add_argument(name, action="store_const", const=value, **hidden)


def check_given(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(notices to log, the refusal to print or ``None``) for the recorded vLLM flags."""
    table = by_name()
    notices: list[str] = []
    for option, values in getattr(args, GIVEN, None) or []:
        row = table[option]
        shown = option if values in (None, [], True) else f"{option} {_text(values)}"
        if row.kind == NOTICE:
            notices.append(f"vLLM flag {shown} ignored: {row.text}")
        elif row.kind == REFUSED and option == row.negative:
            notices.append(f"vLLM flag {shown} accepted: that is how inflight runs ({row.text})")
        elif row.kind == ONLY and _text(values) in row.values:
            notices.append(f"vLLM flag {shown} accepted: {row.note}")
        elif row.kind in (REFUSED, ONLY):
            return notices, f"{shown}: refused: {row.text} (see {DOC})"
    return notices, None


def _text(values: Any) -> str:
    return " ".join(map(str, values)) if isinstance(values, list) else str(values)


def unknown_flags_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The usage error for arguments no flag took: each unknown flag with the closest known one."""
    flags = [e for e in extras if e.startswith("-") and not _is_number(e)]
    if not flags:
        return f"unexpected argument(s): {' '.join(extras)} (one MODEL at most)"
    known = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    parts = []
    for token in flags:
        name = token.split("=", 1)[0]
        match = closest_flag(name, known)
        parts.append(f"{name} (did you mean {match}?)" if match else name)
    plural = "s" if len(parts) > 1 else ""
    return (f"unrecognized argument{plural}: {', '.join(parts)}. vLLM's flags and what inflight does with "
            f"each: {DOC}")


def closest_flag(name: str, known: Sequence[str]) -> str | None:
    """The known flag ``name`` is a near miss of (a typo, a letter or a word off), or ``None``.
    Compared without the dashes every flag shares and at a high cutoff: ``--foo-bar`` is near
    nothing (plain difflib offered ``--root-path``), ``--max-model-length`` is ``--max-model-len``."""
    bare = {flag.lstrip("-"): flag for flag in known}
    match = difflib.get_close_matches(name.lstrip("-"), list(bare), n=1, cutoff=FLAG_SUGGEST_CUTOFF)
    return bare[match[0]] if match else None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """``--max_model_len=8`` -> ``--max-model-len=8``: underscores in flag names, as vLLM accepts."""
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out
