"""StructuredOutputManager: compiles constraints once and gives each request its own matcher.

Compilation (schema/regex/grammar -> llguidance grammar -> an ``LLMatcher`` with its lexer
built against this model's tokenizer) runs in a small worker pool the server awaits before it
adds a request, so the engine loop never waits on it; the engine only copies the compiled
template (``deep_copy``, microseconds). A compile that runs past ``compile_deadline_s``
(measured from when a worker starts it, so a queue is not charged to it) fails its request
with a ``CompileTimeoutError`` (a ``ValueError``: a 400 naming the constraint) and is
remembered, so the same constraint is refused at once next time; llguidance cannot be
interrupted, so the worker finishes it in the background and throws it away. The cache is
keyed by the canonical ``StructuredOutputsParams`` and bounded by entries and by an estimate of
bytes (``cache``). A cache miss on the engine thread (the offline ``LLM`` API, or an entry
evicted between compile and add) compiles through the pool too, under the same deadline.

Each constraint is compiled once per process that needs it, one llguidance construction each
(``num_compiled`` counts them). A manager made with ``keep_compiled=False`` (the front end's,
beside an engine-core process) converts the constraint and checks the grammar against the
tokenizer, and keeps only its verdict: the checked grammar text, which the front end puts on
the request (``StructuredOutputsParams.checked``), so a bad constraint is a 400 there and never
reaches the core. A manager that keeps matchers builds one from a checked constraint's grammar
as it stands (no conversion, no second check: ``num_from_verdict`` counts these), and from an
unchecked one (the offline ``LLM`` API, or the in-process server, whose front end shares this
manager) converts and builds in one go; the matcher's own error state is the check.

The model's logits may be wider than the tokenizer's vocabulary (padded embedding rows): the
llguidance tokenizer is built with the logits' width, so padding tokens are never allowed.
Knows nothing about scheduling, HTTP or sampling beyond the bitmask.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from inflight.runtime.structured.ascii_classes import ascii_classes, bounded, schema_ascii_classes
from inflight.runtime.structured.cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, GrammarCache, estimate_bytes
from inflight.runtime.structured.faults import STALL_CAP_S, GrammarFault, grammar_fault_from_env
from inflight.runtime.structured.params import StructuredOutputsParams

logger = logging.getLogger("inflight.structured")

DEFAULT_CACHE_SIZE = DEFAULT_MAX_ENTRIES
DEFAULT_NUM_WORKERS = 2
# A compile past this many seconds fails its request (a 400). The 8000-property schema
# (215 KB, under the 256 KiB limit) took ~6.5 s of CPU; the schemas real clients send compile
# in milliseconds (tens for the largest tool sets), so 5 s refuses only the pathological.
COMPILE_DEADLINE_S = 5.0
MAX_REMEMBERED_TOO_SLOW = 4096  # digests of constraints that ran past the deadline
VERDICT_BYTES = 256  # a verdict-only entry (keep_compiled=False), beside its grammar text and key
# Compact JSON (no free whitespace): fewer tokens, and a random or weak model cannot wander off
# into endless whitespace between values.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def to_llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for ``params`` (not yet checked). ``\\d \\w \\s`` in a regex
    or a schema's patterns are ECMA-262's ASCII classes (:mod:`.ascii_classes`)."""
    m = llguidance.LLMatcher
    if params.kind == "json":
        spec = params.spec
        if "\\" in spec:  # a pattern may hold a class escape
            spec = bounded(json.dumps(schema_ascii_classes(json.loads(spec)), ensure_ascii=False))
        return m.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if params.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if params.kind == "regex":
        return m.grammar_from_regex(ascii_classes(params.spec))
    if params.kind == "choice":
        choices = json.loads(params.spec)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    try:
        return llguidance.grammar_from("grammar", params.spec)
    except ValueError as exc:
        raise ValueError(f"invalid grammar: {exc}") from None


class CompileTimeoutError(ValueError):
    """A constraint whose compile ran past the deadline (the client's error: a 400)."""


class RequestMatcher:
    """One request's grammar state, advanced once per accepted output token.

    ``fail(reason)`` ends it from outside (a token mask past its deadline); after that the
    llguidance matcher is never touched again from here (a worker may still be using it).
    ``stall``: set by an injected ``slow-mask`` fault (tests only). ``fill``: the token mask
    being filled for the next position; ``slow``: its last mask was late or an advance was
    costly; ``pending_token``: a slow grammar's sampled token, consumed by its next fill, off
    the step (all three kept by :mod:`inflight.runtime.structured.mask_fills`)."""

    __slots__ = ("matcher", "failed", "failure", "stall", "fill", "slow", "pending_token")

    def __init__(self, matcher: llguidance.LLMatcher, stall: threading.Event | None = None) -> None:
        self.matcher = matcher
        self.failed = False
        self.failure: str | None = None
        self.stall = stall
        self.fill: object | None = None
        self.slow = False
        self.pending_token: int | None = None

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and ``failed``) if the grammar refuses it."""
        if not self.failed and not self.matcher.consume_token(token_id):
            self.failed = True
        return not self.failed

    def fail(self, reason: str) -> None:
        """End this grammar: the next ``accept`` refuses, ``error_message`` gives ``reason``."""
        self.failed = True
        self.failure = reason

    def error_message(self) -> str:
        """Why the grammar cannot go on (llguidance's words when it has some)."""
        if self.failure is not None:
            return self.failure
        detail = self.matcher.get_error() if self.matcher.is_error() else ""
        return _first_line(detail) if detail else "the model produced a token the grammar does not allow"

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or the matcher failed)."""
        return self.failed or self.matcher.is_stopped()


class StructuredOutputManager:
    """Per-engine compiler, cache and worker pool. Thread-safe.

    ``cache_bytes``: the bound on the cache's estimated bytes; ``compile_deadline_s``: how long
    one compile may run; ``keep_compiled``: False to cache verdicts only (nothing to match with);
    ``fault``: an injected stall (tests; else ``INFLIGHT_TEST_GRAMMAR_FAULT``)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE, num_workers: int = DEFAULT_NUM_WORKERS, *,
        cache_bytes: int = DEFAULT_MAX_BYTES, compile_deadline_s: float = COMPILE_DEADLINE_S,
        keep_compiled: bool = True, fault: GrammarFault | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos = list(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.cache: GrammarCache[StructuredOutputsParams, Compiled] = GrammarCache(cache_size, cache_bytes)
        self.compile_deadline_s = compile_deadline_s
        self.keep_compiled = keep_compiled
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the cache: held for microseconds
        self._tok_lock = threading.Lock()  # building the llguidance tokenizer: ~1 s for a real vocabulary
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="inflight-grammar")
        self._fault = fault if fault is not None else grammar_fault_from_env()
        self._released = threading.Event()  # ends injected stalls
        self.num_compiled = 0  # llguidance constructions: a check (verdicts only) or a matcher
        self.num_from_verdict = 0  # ... of which matchers built from a carried verdict
        self.num_timed_out = 0

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

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        """The compile of ``params`` (cached): its checked grammar and matcher template. ValueError
        names what is wrong; ``CompileTimeoutError`` when the compile runs past the deadline."""
        with self._lock:
            if params in self.cache:
                return self.cache.get(params)
        return self.submit(params).result()

    def known(self, params: StructuredOutputsParams) -> bool:
        """Whether ``submit`` would answer at once (compiled, or remembered as too slow)."""
        with self._lock:
            return params in self.cache or _digest(params) in self._too_slow

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[Compiled]:
        """Compile in the worker pool (await with ``asyncio.wrap_future``; cancelling the future
        before a worker starts skips the compile)."""
        outer: concurrent.futures.Future[Compiled] = concurrent.futures.Future()
        with self._lock:
            if params in self.cache:
                outer.set_result(self.cache.get(params))
                return outer
            if _digest(params) in self._too_slow:
                outer.set_exception(self._timeout_error(params))
                return outer
        self._pool.submit(self._compile_for, params, outer)
        return outer

    def new_matcher(self, params: StructuredOutputsParams) -> RequestMatcher:
        """A fresh matcher for one request (a copy of the cached template)."""
        template = self.compile(params).matcher
        if template is None:
            raise RuntimeError("this structured-output manager keeps verdicts only; it cannot match")
        stall = self._released if self._fault is not None and self._fault.stalls("slow-mask", params) else None
        return RequestMatcher(template.deep_copy(), stall)

    def release_stalls(self) -> None:
        """End every injected stall so far (tests); later ones stall again."""
        released, self._released = self._released, threading.Event()
        released.set()

    def close(self) -> None:
        self._released.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_for(self, params: StructuredOutputsParams, outer: concurrent.futures.Future[Compiled]) -> None:
        """In a worker: compile under the deadline, settle ``outer``, cache the result."""
        if not outer.set_running_or_notify_cancel():
            return
        timer = threading.Timer(self.compile_deadline_s, self._expire, (params, outer))
        timer.daemon = True
        timer.start()
        try:
            template = self._build(params)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            timer.cancel()
            _settle(outer, exc=exc)
            return
        timer.cancel()
        with self._lock:  # settled under the lock, so the deadline cannot fire in between
            if outer.done():  # expired: refused already, and remembered as too slow
                return
            charged = estimate_bytes(len(template.grammar)) if self.keep_compiled else VERDICT_BYTES
            key_chars = len(params.spec) + len(params.checked_grammar or "")  # what the key holds
            self.cache.put(params, template, charged + len(template.grammar) + key_chars)
            self.num_compiled += 1
            if params.checked_grammar is not None and self.keep_compiled:
                self.num_from_verdict += 1
            _settle(outer, result=template)

    def _expire(self, params: StructuredOutputsParams, outer: concurrent.futures.Future[Compiled]) -> None:
        with self._lock:
            if outer.done():
                return
            self._too_slow[_digest(params)] = None
            while len(self._too_slow) > MAX_REMEMBERED_TOO_SLOW:
                self._too_slow.popitem(last=False)
            self.num_timed_out += 1
            _settle(outer, exc=self._timeout_error(params))

    def _timeout_error(self, params: StructuredOutputsParams) -> CompileTimeoutError:
        return CompileTimeoutError(
            f"the {_WHAT[params.kind]} takes longer than {self.compile_deadline_s:g} s to compile, the most "
            "one constraint may take here; simplify it (fewer optional properties, alternatives or nesting)")

    def _build(self, params: StructuredOutputsParams) -> Compiled:
        """One llguidance construction: the grammar checked (verdicts only) or made a matcher."""
        what = _WHAT[params.kind]
        if self._fault is not None and self._fault.stalls("slow-compile", params):
            self._released.wait(STALL_CAP_S)
        grammar = params.checked_grammar
        if grammar is None:
            try:
                grammar = to_llguidance_grammar(params)
            except ValueError as exc:
                raise ValueError(f"invalid {what}: {exc}") from None
        tokenizer = self.ll_tokenizer
        if not self.keep_compiled:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if is_error:
                raise ValueError(f"invalid {what}: {_first_line(messages[0] if messages else 'unknown error')}")
            logger.debug("grammar checked: a %s (%d grammar characters)", what, len(grammar))
            return Compiled(None, grammar)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():  # the same verdict the check gives (a checked grammar passes it)
            raise ValueError(f"invalid {what}: {_first_line(matcher.get_error())}")
        how = "from its verdict" if params.checked_grammar is not None else "converted and built"
        logger.debug("grammar matcher %s: a %s (%d grammar characters)", how, what, len(grammar))
        return Compiled(matcher, grammar)


class Compiled:
    """A constraint's compile: ``grammar``, the llguidance grammar text it was checked as (the
    verdict a front end carries to the engine), and ``matcher``, the template each request
    copies (``None`` in a manager that keeps verdicts only)."""

    __slots__ = ("matcher", "grammar")

    def __init__(self, matcher: llguidance.LLMatcher | None, grammar: str) -> None:
        self.matcher = matcher
        self.grammar = grammar


_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice list",
         "grammar": "grammar"}


def _digest(params: StructuredOutputsParams) -> bytes:
    return hashlib.sha256(f"{params.kind}\0{params.spec}".encode("utf-8", "surrogatepass")).digest()


def _settle(future: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set ``future``'s outcome unless the deadline (or a cancel) settled it first."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _first_line(message: str, limit: int = 500) -> str:
    return message.strip().splitlines()[0][:limit] if message.strip() else message
