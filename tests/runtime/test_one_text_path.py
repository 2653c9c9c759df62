"""One text path: the engine works on token ids only (no text, no stop strings, no switch to
make it detokenize), and the offline ``LLM`` makes its text through the server's
``OutputText``, which ends a request at its stop string and has it aborted in the engine."""

from __future__ import annotations

import inspect

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.output_processor import OutputProcessor
from inflight.runtime.engine_core.output_text import OutputText, step_with_text


def test_the_engine_takes_no_detokenize_switch() -> None:
    for callable_ in (OutputProcessor, LLMEngine, LLMEngine.from_model_dir):
        params = inspect.signature(callable_).parameters
        assert "detokenize" not in params, callable_
    assert "tokenizer" not in inspect.signature(OutputProcessor).parameters


def test_engine_outputs_carry_no_text_and_the_stop_string_ends_the_request_outside(llama_dir) -> None:
    llm = LLM(llama_dir, num_kv_blocks=64, max_num_sequences=4, device="cpu")
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    full = llm.generate("def fib(n):", SamplingParams(**greedy))[0]
    stop = full.text[5:8]
    cut = llm.generate("def fib(n):", SamplingParams(**greedy, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)

    engine = llm.engine  # the engine alone runs past the stop string: it has no text to look in
    params = SamplingParams(**greedy, stop=[stop])
    prompt = engine.encode_prompt("def fib(n):")
    engine.add_request("raw", prompt, params)
    raw = []
    while engine.has_unfinished_requests():
        raw.extend(engine.step())
    assert all(o.new_text == "" for o in raw)
    assert raw[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in raw) == 24

    text = OutputText(engine.tokenizer, engine.eos_token_ids)  # what LLM does: the same component
    engine.add_request("one-path", prompt, params)
    text.add("one-path", params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(step_with_text(engine, text))
    assert "".join(o.new_text for o in outs) == cut.text and outs[-1].finish_reason == "stop"
    assert [t for o in outs for t in o.new_token_ids] == cut.token_ids
    assert engine.stats().num_used_kv_blocks == 0 and len(text) == 0  # aborted in the engine, forgotten here
    llm.close()


def test_offline_stop_strings_alike_with_async_scheduling(llama_dir) -> None:
    """Under async scheduling the abort reaches the engine while its next step is prepared; the
    text, token ids and finish reason are those of the synchronous engine."""
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    results = []
    for async_scheduling in (False, True):
        with LLM(llama_dir, num_kv_blocks=64, max_num_sequences=4, device="cpu",
                 async_scheduling=async_scheduling) as llm:  # fmt: skip
            stop = llm.generate("def fib(n):", SamplingParams(**greedy))[0].text[5:8]
            cut = llm.generate(["def fib(n):", "import os"], SamplingParams(**greedy, stop=[stop]))
            results.append([(o.text, o.token_ids, o.finish_reason) for o in cut])
            assert llm.engine.stats().num_used_kv_blocks == 0
    assert results[0] == results[1] and results[0][0][2] == "stop"
