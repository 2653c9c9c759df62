"""A grammar is compiled once per process that needs it, and its verdict carried (issue 45).

The front end (a verdicts-only manager) converts a constraint and checks the grammar, once per
distinct constraint; the request then carries the checked grammar text across the pipe
(pickled, as the protocol sends it), and the engine core (a manager that keeps matchers) only
instantiates it: no conversion, no second check. A bad constraint stops at the front end. The
counts are of llguidance's own constructions, seen through a counting stand-in for its
``LLMatcher``; the served test counts the two processes of ``inflight serve`` in their logs."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import llguidance
import pytest

from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured import manager as manager_module
from tests.server.server_helpers import MODEL_NAME, ServeProcess, http
from tests.structured.grammar_helpers import load_tokenizer, make_llama, make_manager

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
# The same schema three ways (dict, JSON text with other whitespace), then a second schema.
REQUESTS = [SCHEMA, json.dumps(SCHEMA, indent=2), json.dumps(SCHEMA), {"type": "array", "items": {"type": "boolean"}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory, "compile-once")


tokenizer = pytest.fixture(scope="module")(load_tokenizer)  # of model_dir


class _Counting:
    """Stands in for ``llguidance.LLMatcher`` in the manager: counts conversions (schema ->
    grammar), checks and matcher constructions, and does each with the real one."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        real = llguidance.LLMatcher

        def counted(kind: str, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.counts[kind] += 1
                return fn(*args, **kwargs)
            return call

        self.grammar_from_json_schema = counted("convert", real.grammar_from_json_schema)
        self.grammar_from_regex = counted("convert", real.grammar_from_regex)
        self.grammar_from_lark = counted("convert", real.grammar_from_lark)
        self.validate_grammar_with_warnings = counted("check", real.validate_grammar_with_warnings)
        self._new = counted("matcher", real)

    def __call__(self, *args: Any, **kwargs: Any) -> llguidance.LLMatcher:
        return self._new(*args, **kwargs)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    stand_in = _Counting()
    monkeypatch.setattr(manager_module.llguidance, "LLMatcher", stand_in)
    return stand_in


def test_the_front_end_checks_once_and_the_core_only_instantiates(tokenizer, counting: _Counting) -> None:  # noqa: ANN001
    front, core = make_manager(tokenizer, keep_compiled=False), make_manager(tokenizer)
    try:
        front_counts: Counter[str] = Counter()
        for schema in REQUESTS:
            params = StructuredOutputsParams.json_schema(schema)
            before = Counter(counting.counts)
            verdict = front.compile(params)
            front_counts += counting.counts - before
            sent = pickle.loads(pickle.dumps(params.checked(verdict.grammar)))  # across the pipe
            assert sent == params and sent.checked_grammar == verdict.grammar
            core.submit(sent).result(30)  # the core's compile, off its step loop
            core.new_matcher(sent)  # add_request: a copy of the template
        core_counts = counting.counts - front_counts
    finally:
        front.close()
        core.close()
    distinct = 2
    assert front_counts == {"convert": distinct, "check": distinct}  # no matcher in the front end
    assert core_counts == {"matcher": distinct}  # no conversion, no second check
    assert (front.num_compiled, core.num_compiled, core.num_from_verdict) == (distinct, distinct, distinct)


def test_one_manager_for_both_compiles_once(tokenizer, counting: _Counting) -> None:  # noqa: ANN001
    """The in-process server (and the offline ``LLM``): the front end shares the engine's manager,
    whose one construction is the matcher, its error state the check."""
    shared = make_manager(tokenizer)
    try:
        for schema in REQUESTS:
            params = StructuredOutputsParams.json_schema(schema)
            checked = params.checked(shared.submit(params).result(30).grammar)
            shared.new_matcher(checked)
    finally:
        shared.close()
    assert counting.counts == {"convert": 2, "matcher": 2} and shared.num_compiled == 2


def test_a_bad_schema_stops_at_the_front_end(tokenizer, counting: _Counting) -> None:  # noqa: ANN001
    front = make_manager(tokenizer, keep_compiled=False)
    try:
        with pytest.raises(ValueError, match="invalid JSON schema: Unsatisfiable schema"):
            front.compile(StructuredOutputsParams.json_schema({"type": "object", "minProperties": 3,
                                                               "properties": {}, "additionalProperties": False}))
    finally:
        front.close()
    assert front.num_compiled == 0 and counting.counts["matcher"] == 0


def test_a_matcher_from_the_verdict_equals_one_compiled_from_scratch(tokenizer) -> None:  # noqa: ANN001
    front, core, alone = make_manager(tokenizer, keep_compiled=False), make_manager(tokenizer), make_manager(tokenizer)
    try:
        params = StructuredOutputsParams.json_schema(SCHEMA)
        carried = core.new_matcher(params.checked(front.compile(params).grammar)).matcher
        scratch = alone.new_matcher(params).matcher
        tokens = tokenizer.encode('{"city":"Oslo","days":3}', add_special_tokens=False)
        assert carried.validate_tokens(tokens) == scratch.validate_tokens(tokens) == len(tokens)
        assert carried.validate_tokens(tokenizer.encode('{"town"', add_special_tokens=False)) \
            == scratch.validate_tokens(tokenizer.encode('{"town"', add_special_tokens=False))
    finally:
        for m in (front, core, alone):
            m.close()


def test_served_in_two_processes_each_compiles_a_schema_once(model_dir: Path) -> None:
    """``inflight serve``: the front end checks each distinct schema once, the engine core builds
    one matcher per schema from the carried verdict and converts nothing; a bad schema is the
    front end's 400 and never reaches the core."""
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
                           "--max-num-sequences", "2", "--num-kv-blocks", "64", "--max-model-len", "512",
                           "--log-level", "debug", "--log-format", "text"])
    try:
        server.wait_ready()
        bodies = [*REQUESTS, {"type": "object", "minProperties": 3, "properties": {}, "additionalProperties": False}]
        statuses = []
        for schema in bodies:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8}
            if isinstance(schema, str):  # JSON text: vLLM's guided_json takes it (response_format does not)
                body["guided_json"] = schema
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
            reply = http("POST", server.url + "/v1/chat/completions", body)
            statuses.append((reply.status, reply.json().get("error", {}).get("param")))
        log = server.log()
    finally:
        server.stop()
    assert statuses == [(200, None)] * 4 + [(400, "response_format")]
    assert log.count("grammar checked: a JSON schema") == 2, log
    assert log.count("grammar matcher from its verdict: a JSON schema") == 2, log
    assert "grammar matcher converted and built" not in log
