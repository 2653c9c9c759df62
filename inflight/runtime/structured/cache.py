"""The compiled-grammar cache: least recently used out, bounded by entries and by bytes.

llguidance does not report how much memory a compiled matcher holds, so each entry is charged
an estimate from its grammar text (:func:`estimate_bytes`). Not thread-safe: the manager holds
its lock around every call. Knows nothing about llguidance beyond an opaque value per key.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_MAX_ENTRIES = 256
# One engine's compiled grammars (the front end keeps verdicts only: each grammar's text, no matcher).
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
# A compiled matcher holds its lexer and grammar tables: ~113 bytes per character of grammar
# text measured here (800-property schemas, a 1k-token vocabulary), 140-300 on SmolLM2's 49k
# vocabulary (a 215 KB schema held 30-65 MB, issue 19). Charge the upper end.
BYTES_PER_GRAMMAR_CHAR = 300
BYTES_PER_ENTRY = 64 * 1024  # the matcher's fixed part, charged even for a tiny grammar


def estimate_bytes(grammar_chars: int) -> int:
    """The memory charged to one compiled grammar of ``grammar_chars`` characters."""
    return BYTES_PER_ENTRY + BYTES_PER_GRAMMAR_CHAR * grammar_chars


class GrammarCache(Generic[K, V]):
    """``get`` refreshes an entry; ``put`` evicts the least recently used entries until both
    bounds hold (an entry larger than ``max_bytes`` alone is not kept at all)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a grammar cache needs room for at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evicted = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, num_bytes: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
        if num_bytes > self.max_bytes:
            return
        self._entries[key] = (value, num_bytes)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, (_, evicted_bytes) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_bytes
            self.num_evicted += 1
