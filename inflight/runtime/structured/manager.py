"""StructuredOutputManager: compiles constraints once and gives each request its own matcher.

Compilation (schema/regex/grammar -> llguidance grammar -> an ``LLMatcher`` with its lexer
built against this model's tokenizer) runs in a small worker pool the server awaits before it
adds a request, so the engine loop never waits on it; the engine only copies the compiled
template (``deep_copy``, microseconds). The cache is bounded (least recently used out) and
keyed by the canonical ``StructuredOutputsParams``. A cache miss on the engine thread (the
offline ``LLM`` API, or an entry evicted between compile and add) compiles in place.

The model's logits may be wider than the tokenizer's vocabulary (padded embedding rows): the
llguidance tokenizer is built with the logits' width, so padding tokens are never allowed.
Knows nothing about scheduling, HTTP or sampling beyond the bitmask.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from inflight.runtime.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
DEFAULT_NUM_WORKERS = 2
# Compact JSON (no free whitespace): fewer tokens, and a random or weak model cannot wander off
# into endless whitespace between values.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def to_llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for ``params`` (not yet checked)."""
    m = llguidance.LLMatcher
    if params.kind == "json":
        return m.grammar_from_json_schema(params.spec, overrides=JSON_OPTIONS)
    if params.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if params.kind == "regex":
        return m.grammar_from_regex(params.spec)
    if params.kind == "choice":
        choices = json.loads(params.spec)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    try:
        return llguidance.grammar_from("grammar", params.spec)
    except ValueError as exc:
        raise ValueError(f"invalid grammar: {exc}") from None


class RequestMatcher:
    """One request's grammar state, advanced once per accepted output token."""

    __slots__ = ("matcher", "failed")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and ``failed``) if the grammar refuses it."""
        if not self.failed and not self.matcher.consume_token(token_id):
            self.failed = True
        return not self.failed

    def error_message(self) -> str:
        """Why the grammar cannot go on (llguidance's words when it has some)."""
        detail = self.matcher.get_error() if self.matcher.is_error() else ""
        return _first_line(detail) if detail else "the model produced a token the grammar does not allow"

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or the matcher failed)."""
        return self.failed or self.matcher.is_stopped()


class StructuredOutputManager:
    """Per-engine compiler, cache and worker pool. Thread-safe."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE, num_workers: int = DEFAULT_NUM_WORKERS,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos = list(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the executor: held for microseconds
        self._tok_lock = threading.Lock()  # building the llguidance tokenizer: ~1 s for a real vocabulary
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="inflight-grammar")
        self.num_compiled = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tok_lock:
            if self._ll_tokenizer is None:
                if not self._eos:
                    raise ValueError("this model has no EOS token, which structured outputs need to end")
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                    )
                except ValueError as exc:
                    raise ValueError(f"structured outputs need a fast (Rust) tokenizer: {exc}") from None
            return self._ll_tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's thread pool for filling many rows' masks at once."""
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            return self._executor

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled template for ``params`` (cached). ValueError names what is wrong."""
        with self._lock:
            template = self._cache.get(params)
            if template is not None:
                self._cache.move_to_end(params)
                return template
        template = self._build(params)
        with self._lock:
            self._cache[params] = template
            self._cache.move_to_end(params)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return template

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[llguidance.LLMatcher]:
        """Compile in the worker pool (await with ``asyncio.wrap_future``)."""
        return self._pool.submit(self.compile, params)

    def new_matcher(self, params: StructuredOutputsParams) -> RequestMatcher:
        """A fresh matcher for one request (a copy of the cached template)."""
        return RequestMatcher(self.compile(params).deep_copy())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}[params.kind]
        try:
            grammar = to_llguidance_grammar(params)
        except ValueError as exc:
            raise ValueError(f"invalid {what}: {exc}") from None
        tokenizer = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"invalid {what}: {_first_line(messages[0] if messages else 'unknown error')}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {what}: {_first_line(matcher.get_error())}")
        return matcher


def _first_line(message: str, limit: int = 500) -> str:
    return message.strip().splitlines()[0][:limit] if message.strip() else message
