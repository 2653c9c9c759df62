"""IncrementalDetokenizer: a request's output text, token by token, with stop strings.

Decodes a small window of recent tokens per step instead of the whole output, holds back
bytes of an unfinished UTF-8 character, finds stop strings (which are cut from the text)
and holds back a tail that might be the start of one, so streamed deltas never have to be
taken back. Where the tokenizer allows (:func:`stream_decoding`, chosen once per tokenizer),
the window is decoded by ``tokenizers``' own :class:`~tokenizers.decoders.DecodeStream` (the
same window, the same rule, in Rust: one call per token instead of two); elsewhere, and for the
rest of a request whose stream reports a window that is not a prefix of the next, in Python.
Knows nothing about torch or scheduling.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenizers.decoders import DecodeStream

# Decoders that work token by token (``decode_chain``), so the text of a window is a prefix of
# the text of the window plus more tokens: DecodeStream's rule then gives our text exactly.
# Only what the sameness test covers (tests/runtime/test_detokenizer_stream.py).
_STREAM_DECODERS = frozenset({"ByteLevel"})


class IncrementalDetokenizer:
    """Feed tokens with :meth:`append`; read deltas with :meth:`take_delta`."""

    def __init__(
        self, tokenizer: Any, stop: tuple[str, ...], skip_token_ids: frozenset[int], stream: Any | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        """``stream``: :func:`stream_decoding` of ``tokenizer`` (its Rust tokenizer), to decode
        with a :class:`DecodeStream`; None decodes the window in Python. ``skip_special_tokens``
        False keeps special tokens in the text (``skip_token_ids``, EOS and stop tokens, never are)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.skip_token_ids = skip_token_ids  # EOS / stop tokens: never part of the text
        self.token_ids: list[int] = []
        # The text is the deltas handed out, then the tail not handed out yet: appending a token
        # touches only the tail (``self.text += new`` copied the whole output every token: its
        # cost grew with the output, quadratic over a long answer).
        self._sent: list[str] = []
        self._tail = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the text (the earliest in it)
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = _backend_decoder(tokenizer, skip_special_tokens) or self._decode_slow
        self._backend = stream
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if stream is not None else None

    def append(self, token_id: int) -> bool:
        """Add one generated token; True if the text now contains a stop string (then cut there)."""
        if self.stopped or token_id in self.skip_token_ids:
            return False
        self.token_ids.append(token_id)
        if self._stream is not None:
            try:
                new_text = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception ("Invalid prefix")
                new_text = self._leave_the_stream()
        else:
            new_text = self._step_window()
        if new_text is None:
            return False  # an incomplete character: wait for more bytes
        old_len = len(self._tail)
        self._tail += new_text
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._find_stop(old_len) if self.stop else False

    def _step_window(self) -> str | None:
        prefix, full = self._decode_window()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix) :]

    def _leave_the_stream(self) -> str | None:
        """The stream's window and rule are the Python ones (the offsets here mirror its own);
        where its prefix check fails (a window whose text changed with the next token), the
        Python window decodes this token and the rest of the request, as it always has."""
        self._stream = None
        return self._step_window()

    @property
    def text(self) -> str:
        """The whole text so far (stop strings cut)."""
        return "".join(self._sent) + self._tail

    def _find_stop(self, old_len: int) -> bool:
        """Look for a stop string ending in the tail's new text (``old_len``: the tail's length
        before it). The tail holds every character a stop string could start at: a delta never
        hands out the last ``max_stop_len - 1`` characters of an unfinished text."""
        if not self.stop:
            return False
        start = max(0, old_len - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self._tail.find(s, start)) >= 0]
        if not hits:
            return False
        cut, self.stop_hit = min(hits)
        self._tail = self._tail[:cut]
        self.stopped = True
        return True

    def flush(self) -> None:
        """At the end of the request: decode whatever is still held back."""
        if self.stopped or self.read_offset == len(self.token_ids):
            return
        prefix, full = self._decode_window()
        self._tail += full[len(prefix) :]
        self.read_offset = len(self.token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a tail that may still become a stop string."""
        tail = self._tail
        end = len(tail)
        if not finished and self.max_stop_len > 1:
            end = max(0, end - (self.max_stop_len - 1))
        if not end:
            return ""
        delta, self._tail = tail[:end], tail[end:]
        self._sent.append(delta)
        return delta

    def _decode_window(self) -> tuple[str, str]:
        """Text of the tokens already read, and of those plus the new ones, since prefix_offset."""
        return (
            self._decode_ids(self.token_ids[self.prefix_offset : self.read_offset]),
            self._decode_ids(self.token_ids[self.prefix_offset :]),
        )

    def _decode_slow(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)


def _backend_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str] | None:
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
    return lambda token_ids: decode(token_ids, skip_special_tokens=skip_special_tokens)


def stream_decoding(tokenizer: Any) -> Any | None:
    """The Rust tokenizer to decode ``tokenizer``'s output with a :class:`DecodeStream`, or None
    where that would not give exactly the Python window's text: a tokenizer whose ``decode``
    is not the Rust one as it is (:func:`_backend_decoder`), or whose decoder is not known to
    work token by token. Choose once per tokenizer."""
    if _backend_decoder(tokenizer) is None:
        return None
    backend = tokenizer._tokenizer
    if backend.decoder is None:
        return None
    decoder = json.loads(backend.decoder.__getstate__())  # the decoder's own JSON (not the vocabulary's)
    parts = decoder.get("decoders", ()) if decoder.get("type") == "Sequence" else (decoder,)
    if not parts or any(part.get("type") not in _STREAM_DECODERS for part in parts):
        return None
    return backend
