"""What ``inflight serve`` does with each ``vllm serve`` flag: lookups and the doc's table.

Owns ``by_name`` (every spelling -> its row) and ``markdown_tables``, the table of
docs/from-vllm.md (between the ``vllm-flags`` markers; ``python -m inflight.runtime.cli.vllm_flags``
rewrites it). The row type and kinds are ``vllm_flag_kinds``, the rows ``vllm_flag_rows`` (and
``vllm_flag_rows_engine``); both are re-exported here. Knows nothing about argparse (``cli_vllm`` wires the rows into the parser).
"""

from __future__ import annotations

import sys
from pathlib import Path

from inflight.generated_docs import replace_section
from inflight.runtime.cli.vllm_flag_kinds import ALIAS, NOTICE, ONLY, REFUSED, VALUE_ALIASES, VllmFlag
from inflight.runtime.cli.vllm_flag_rows import FLAGS, LEGACY, SECTIONS, VLLM_RELEASE

__all__ = ["ALIAS", "FLAGS", "LEGACY", "NOTICE", "ONLY", "REFUSED", "SECTIONS", "VALUE_ALIASES", "VLLM_RELEASE",
           "VllmFlag", "by_name", "markdown_tables", "with_tables"]
DOC_BEGIN, DOC_END = "<!-- vllm-flags:begin -->", "<!-- vllm-flags:end -->"


def by_name() -> dict[str, VllmFlag]:
    """Every vLLM spelling (``--no-`` forms included) -> its row."""
    table: dict[str, VllmFlag] = {}
    for flag in FLAGS:
        for name in (*flag.names, flag.negative):
            if name is not None:
                table[name] = flag
    return table


def _spellings(flag: VllmFlag) -> str:
    names = [*flag.names[:1], *([flag.negative] if flag.negative else []), *flag.names[1:]]
    return ", ".join(f"`{n}`" for n in names)


def _answer(flag: VllmFlag) -> tuple[str, str]:
    """(what inflight does, why / notes) for the doc's table."""
    if flag.kind == ALIAS:
        target = f"`{flag.text}`" if flag.text not in flag.names else "same"
        return target, flag.note
    if flag.kind == NOTICE:
        return "accepted, ignored (notice)", flag.text
    if flag.kind == REFUSED:
        tail = f"; `{flag.negative}` accepted" if flag.negative else ""
        return f"refused{tail}", flag.text
    values = ", ".join(f"`{v}`" for v in flag.values)
    return f"{values} accepted (notice); other values refused", f"{flag.note}; other values: {flag.text}"


def markdown_tables() -> str:
    """The generated part of docs/from-vllm.md: one table per group of vLLM's ``serve`` flags."""
    num_current = len(FLAGS) - len(LEGACY)
    lines = [f"Generated from `inflight/runtime/cli/vllm_flag_rows*.py`: the {num_current} flags of vLLM "
             f"{VLLM_RELEASE}'s `vllm serve` and {len(LEGACY)} of earlier releases; a test checks that "
             "the parser does what this says."]
    for title, rows in SECTIONS:
        lines += ["", f"#### {title}", "", "| vLLM | inflight | Why / notes |", "|---|---|---|"]
        for flag in rows:
            what, why = _answer(flag)
            lines.append(f"| {_spellings(flag)} | {what} | {why.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


def with_tables(doc: str) -> str:
    """``doc`` with the text between the markers replaced by :func:`markdown_tables`."""
    return replace_section(doc, DOC_BEGIN, DOC_END, markdown_tables())


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/from-vllm.md")
    path.write_text(with_tables(path.read_text()))
