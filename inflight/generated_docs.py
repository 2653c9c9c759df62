"""Generated sections of the docs: the text between two HTML-comment markers, rewritten from code.

``docs/environment.md`` (from :mod:`inflight.env_vars`) and ``docs/from-vllm.md`` (from
:mod:`inflight.runtime.cli.vllm_flags`) each hold such a section; tests compare it with what the
code generates now. Knows nothing about what the sections say.
"""

from __future__ import annotations


def replace_section(doc: str, begin: str, end: str, body: str) -> str:
    """``doc`` with the text between the ``begin`` and ``end`` markers replaced by ``body``."""
    head, found_begin, rest = doc.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the doc has no {begin} ... {end} section")
    return f"{head}{begin}\n{body}\n{end}{tail}"
