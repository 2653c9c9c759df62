"""Chat templates shipped with inflight, by name: ``--chat-template smollm2-tools``.

* ``smollm2-tools``: SmolLM2-Instruct's own ChatML template plus Hermes-style tools (listed in
  the system turn inside ``<tools></tools>``, calls as ``<tool_call>{"name", "arguments"}
  </tool_call>``, results as a ``tool`` turn naming the tool), for ``--tool-call-parser hermes``.

The ``.jinja`` files beside this module are package data. :func:`resolve` turns a builtin name
into its file's path (a file of that name in the working directory wins, as a path always
does). Knows nothing about tokenizers or serving.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN = {"smollm2-tools": "smollm2-tools.jinja"}


def builtin_path(name: str) -> Path | None:
    """The packaged file of the builtin template ``name``, or ``None`` when there is none."""
    file = BUILTIN.get(name)
    return None if file is None else Path(__file__).with_name(file)


def resolve(value: str) -> str:
    """``--chat-template``'s value with a builtin name replaced by its file's path."""
    path = builtin_path(value)
    if path is None or Path(value).is_file():
        return value
    return str(path)
