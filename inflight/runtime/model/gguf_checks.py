"""The bounds a GGUF file is held to before anything is allocated from what it declares, and the
one error every refusal raises.

A GGUF header declares counts (tensors, key/value pairs, array items), lengths (strings, tensor
dimensions) and hyperparameters (layers, widths, heads, context length) that a reader turns into
loops and allocations, and a broken or hostile file can declare 2^64 of any of them. Each count
is checked before it is used, twice: against the bytes left in the file (N items of at least k
bytes each must fit in them) and against a bound no real model comes near. Hyperparameters must
be numbers of the right kind, in range and finite. :class:`GGUFError` says what is wrong in one
line naming the file and the field, and is a ``ValueError``, so ``inflight serve`` prints it as
its one-line start-up error. Knows nothing about the file's layout or about models.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

MAX_TENSORS = 1 << 16  # tensor infos (Llama 3.1 405B: 1,138)
MAX_KV_PAIRS = 1 << 16  # metadata keys (real files: tens)
MAX_ARRAY_ITEMS = 1 << 21  # items of one string or nested array (the largest vocabularies: ~262k)
MAX_STRING_ITEMS = 1 << 22  # string items in all arrays of a file together (vocabulary + merges)
MAX_NESTING = 4  # arrays of arrays
MAX_KEY_BYTES = 1 << 16  # a metadata key (the GGUF spec: 65,535)
MAX_TENSOR_NAME_BYTES = 256  # llama.cpp refuses 64 and more
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # embedding, feed-forward and head widths
MAX_HEADS = 1 << 12
MAX_VOCAB = 1 << 21
MAX_CONTEXT = 1 << 24  # positions (rope tables are sized from it)

_SHOWN_CHARS = 80


class GGUFError(ValueError):
    """A GGUF file that cannot be served: ``<file>: bad GGUF file: <field>: <problem>``, one line."""

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.field = field
        super().__init__(" ".join(f"{path}: bad GGUF file: {field}: {problem}".split()))


def shown(text: str) -> str:
    """A name taken from the file, quoted and cut short for a one-line message."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def need_room(path: Path, field: str, count: int, item_bytes: int, left: int, bound: int | None = None) -> None:
    """Refuse ``count`` items of at least ``item_bytes`` each that cannot fit in the ``left``
    bytes of the file, or that exceed ``bound``, before any of them is read."""
    if bound is not None and count > bound:
        raise GGUFError(path, field, f"declares {count} items, more than the {bound} any real model needs")
    if count * item_bytes > left:
        raise GGUFError(path, field, f"declares {count} items of at least {item_bytes} bytes but only "
                        f"{left} bytes are left in the file (a truncated or corrupt GGUF header)")


def int_in(path: Path, key: str, value: Any, low: int, high: int) -> int:
    """``value`` as an integer metadata value in ``low..high``, or a :class:`GGUFError` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(path, key, f"must be an integer, not {_kind(value)}")
    if not low <= value <= high:
        raise GGUFError(path, key, f"{value} is out of range {low}..{high}")
    return value


def finite_in(path: Path, key: str, value: Any, low: float, high: float) -> float:
    """``value`` as a finite number in ``low..high`` exclusive of ``low`` (epsilons, rope bases)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(path, key, f"must be a number, not {_kind(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise GGUFError(path, key, f"{number} is not a finite number")
    if not low < number <= high:
        raise GGUFError(path, key, f"{number} is out of range ({low}, {high}]")
    return number


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {shown(str(value))}"


def field_name(text: str) -> str:
    """A metadata key or tensor name from the file as a message's field: as it is when plain,
    quoted and cut short otherwise (control characters, spaces, very long names)."""
    plain = text.isprintable() and not any(c.isspace() for c in text) and 0 < len(text) <= _SHOWN_CHARS
    return text if plain else shown(text)
