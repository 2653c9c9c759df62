"""The in-memory store of finished responses, for ``previous_response_id`` and
``GET /v1/responses/{id}``: bounded, least recently used out first.

Off unless the server enables it (``--enable-responses-store``, as vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE``): it keeps every stored conversation in memory until
evicted, and each front end process (``--api-server-count``) has its own. Knows nothing about
HTTP or how responses are made.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024  # --enable-responses-store without --responses-store-size


@dataclass(frozen=True, slots=True)
class Stored:
    """A finished response and its whole conversation (input items, then its output items)."""

    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]


class ResponseStore:
    """At most ``max_entries`` responses by id; the least recently used is evicted first."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"the responses store needs room for at least 1 response (got {max_entries})")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        items = (*input_items, *response["output"])
        self._entries[response["id"]] = Stored(response, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored
