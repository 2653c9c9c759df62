"""Bounded grammar cost: the compiled-grammar cache stays under its byte bound, a compile past
its deadline is refused (and remembered) without holding up other compiles, and a row whose
token mask is past its deadline ends its request with an error while the other rows of the
same batch finish with exactly their greedy tokens. Slowness is injected (a stall the test
releases), never raced against a clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured.cache import GrammarCache, estimate_bytes
from inflight.runtime.structured.faults import GrammarFault, parse_grammar_fault
from inflight.runtime.structured.manager import VERDICT_BYTES, CompileTimeoutError
from tests.structured.grammar_helpers import load_tokenizer, make_llama, make_manager

SLOW = "slow-marker"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory, "grammar-budgets")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # noqa: ANN201
    return load_tokenizer(model_dir)


def _schema(i: int, num_props: int = 60) -> StructuredOutputsParams:
    props = {f"field_{i}_{j}": {"type": "string", "maxLength": 8} for j in range(num_props)}
    return StructuredOutputsParams.json_schema({"type": "object", "properties": props})


def test_the_cache_evicts_by_bytes_least_recently_used_first() -> None:
    cache: GrammarCache[str, int] = GrammarCache(max_entries=10, max_bytes=100)
    for key in "abc":
        cache.put(key, 0, 30)
    assert cache.get("a") == 0  # a is now the most recent: b goes first
    cache.put("d", 0, 30)
    assert "b" not in cache and len(cache) == 3 and cache.num_bytes == 90
    cache.put("huge", 0, 101)  # larger than the whole budget: not kept, nothing evicted for it
    assert "huge" not in cache and cache.num_bytes == 90


def test_many_distinct_large_schemas_keep_the_cache_under_its_byte_bound(tokenizer) -> None:  # noqa: ANN001
    one = estimate_bytes(len(_schema(0).spec))  # about one entry's charge
    manager = make_manager(tokenizer, cache_bytes=3 * one)
    try:
        for i in range(12):
            manager.compile(_schema(i))
            assert manager.cache.num_bytes <= 3 * one
        assert manager.num_compiled == 12 and 1 <= len(manager.cache) <= 3
        assert manager.cache.num_evicted == 12 - len(manager.cache)
        assert _schema(11) in manager.cache and _schema(0) not in manager.cache
    finally:
        manager.close()


def test_a_verdict_only_manager_holds_no_matchers(tokenizer) -> None:  # noqa: ANN001
    manager = make_manager(tokenizer, keep_compiled=False)
    try:
        verdict = manager.submit(_schema(0)).result(30)
        assert verdict.matcher is None and verdict.grammar  # the checked grammar text, no matcher
        assert manager.cache.num_bytes <= VERDICT_BYTES + len(verdict.grammar) + len(_schema(0).spec)
        assert manager.cache.num_bytes < estimate_bytes(len(verdict.grammar)) // 4  # a matcher's charge
        with pytest.raises(ValueError, match="invalid regex"):
            manager.compile(StructuredOutputsParams.regex("a["))
    finally:
        manager.close()


def test_a_compile_past_its_deadline_is_refused_and_remembered(tokenizer) -> None:  # noqa: ANN001
    slow = StructuredOutputsParams.regex(f"{SLOW}[a-z]+")
    manager = make_manager(tokenizer, compile_deadline_s=0.05, fault=GrammarFault("slow-compile", SLOW))
    try:
        with pytest.raises(CompileTimeoutError, match="longer than 0.05 s to compile"):
            manager.submit(slow).result(30)
        assert manager.num_timed_out == 1
        quick = manager.submit(StructuredOutputsParams.regex("[0-9]+"))  # the other worker is free
        assert quick.result(30).matcher is not None
        again = manager.submit(slow)  # refused at once, without a second compile
        assert again.done() and isinstance(again.exception(), CompileTimeoutError)
    finally:
        manager.close()
    assert manager.num_compiled == 1 and slow not in manager.cache


def test_grammar_faults_parse() -> None:
    assert parse_grammar_fault("") is None
    assert parse_grammar_fault("slow-mask:xyz") == GrammarFault("slow-mask", "xyz")
    with pytest.raises(ValueError, match="slow-compile:MARKER"):
        parse_grammar_fault("slow-lexer:xyz")


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str, str | None]]:
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    ends: dict[str, tuple[str, str | None]] = {}
    for req_id, params in requests.items():
        engine.add_request(req_id, engine.encode_prompt(f"prompt {req_id}"), params)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                ends[out.req_id] = (out.finish_reason or "", out.error)
    return {r: (tokens[r], *ends[r]) for r in requests}


def test_a_late_mask_ends_its_request_and_the_batch_goes_on(model_dir: Path) -> None:
    config = EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=512)
    regex = StructuredOutputsParams.regex("(ab|cd)+")
    requests = {
        "free": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        "constrained": SamplingParams(max_tokens=12, temperature=0.0, structured=regex),
    }
    expected = _run(LLMEngine.from_model_dir(model_dir, config), requests)
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.structured._fault = GrammarFault("slow-mask", SLOW)  # noqa: SLF001 - the injected fault
    engine.parked.deadline_s = 0.05
    slow = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutputsParams.regex(f"{SLOW}x*"))
    try:
        got = _run(engine, {**requests, "slow": slow})
    finally:
        engine.structured.release_stalls()
    assert got["free"] == expected["free"] and got["constrained"] == expected["constrained"]
    slow_tokens, reason, error = got["slow"]
    assert reason == "error" and "took longer than 0.05 s" in (error or "")
    assert slow_tokens == []  # parked from its first token until the deadline ended it
    assert engine.scheduler.has_unfinished() is False and engine.stats().kv_cache_usage == 0


def test_the_server_refuses_a_slow_compile_and_a_late_mask_as_the_clients_error(
    llama_server, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0)
    engine = llama_server.engine
    monkeypatch.setattr(engine.structured, "compile_deadline_s", 0.05)
    monkeypatch.setattr(engine.parked, "deadline_s", 0.05)
    try:
        monkeypatch.setattr(engine.structured, "_fault", GrammarFault("slow-compile", SLOW))
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body={"guided_regex": f"{SLOW}1"})
        assert info.value.body["param"] == "guided_regex" and "to compile" in info.value.body["message"]
        monkeypatch.setattr(engine.structured, "_fault", GrammarFault("slow-mask", SLOW))
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body={"guided_regex": f"{SLOW}2"})
        assert info.value.body["code"] == "constraint_failed" and "took longer than 0.05 s" in info.value.body["message"]
    finally:
        engine.structured.release_stalls()
    ok = client.completions.create(model="demo", prompt="x", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert ok.choices[0].text in ("yes", "no")
    assert engine.stats().num_used_kv_blocks == 0
