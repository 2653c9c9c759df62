"""IncrementalDetokenizer: a request's output text, token by token, with stop strings.

Decodes a small window of recent tokens per step instead of the whole output, holds back
bytes of an unfinished UTF-8 character, finds stop strings (which are cut from the text)
and holds back a tail that might be the start of one, so streamed deltas never have to be
taken back. Knows nothing about torch or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class IncrementalDetokenizer:
    """Feed tokens with :meth:`append`; read deltas with :meth:`take_delta`."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], skip_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.skip_token_ids = skip_token_ids  # EOS / stop tokens: never part of the text
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = 0
        self.stopped = False
        self._decode_ids = _backend_decoder(tokenizer) or self._decode_slow

    def append(self, token_id: int) -> bool:
        """Add one generated token; True if the text now contains a stop string (then cut there)."""
        if self.stopped or token_id in self.skip_token_ids:
            return False
        self.token_ids.append(token_id)
        prefix, full = self._decode_window()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for more bytes
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> bool:
        if not self.stop:
            return False
        start = max(0, old_len - self.max_stop_len + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def flush(self) -> None:
        """At the end of the request: decode whatever is still held back."""
        if self.stopped or self.read_offset == len(self.token_ids):
            return
        prefix, full = self._decode_window()
        self.text += full[len(prefix) :]
        self.read_offset = len(self.token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a tail that may still become a stop string."""
        end = len(self.text)
        if not finished and self.max_stop_len > 1:
            end = max(self.emitted, end - (self.max_stop_len - 1))
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _decode_window(self) -> tuple[str, str]:
        """Text of the tokens already read, and of those plus the new ones, since prefix_offset."""
        return (
            self._decode_ids(self.token_ids[self.prefix_offset : self.read_offset]),
            self._decode_ids(self.token_ids[self.prefix_offset :]),
        )

    def _decode_slow(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _backend_decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The Rust ``tokenizers`` decode, when ``tokenizer.decode`` would return exactly its result.

    That holds for transformers' fast tokenizer class with its own ``_decode`` (no subclass
    override) and no clean-up of spaces (we never ask for it). It skips the wrapper's Python
    (argument conversion, dispatch): 2.5 us instead of 6 us a call, two calls per token.
    """
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    if backend is None or not hasattr(backend, "decode"):
        return None
    decode = backend.decode
    return lambda token_ids: decode(token_ids, skip_special_tokens=True)
