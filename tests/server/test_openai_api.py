"""The live server driven by the official ``openai`` client: completions and chat, streaming
and not, n > 1, stop strings, logprobs, usage, and agreement with the offline API."""

from __future__ import annotations

import json
import logging

import pytest

from inflight.runtime.sampling_params import SamplingParams
from tests.server.server_helpers import MAIN_CONFIG, MODEL_NAME, LiveServer, http, parse_metrics

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Queue:"]
GREEDY = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})

CONTRACT_METRICS = (
    "inflight:kv_cache_usage_perc", "inflight:num_requests_running", "inflight:num_requests_waiting",
    "inflight:max_num_sequences", "inflight:num_kv_blocks", "inflight:num_preemptions_total",
    "inflight:prompt_tokens_total", "inflight:generation_tokens_total",
    "inflight:prefix_cache_queries_total", "inflight:prefix_cache_hits_total",
    "inflight:request_success_total", "inflight:time_to_first_token_seconds",
    "inflight:inter_token_latency_seconds", "inflight:request_time_per_output_token_seconds",
    "inflight:e2e_request_latency_seconds", "inflight:request_queue_time_seconds",
    "inflight:iteration_tokens_total",
)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def _stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_models_health_ready(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http("GET", f"{server.url}/health").status == 200
    assert http("GET", f"{server.url}/ready").json() == {"status": "ready"}


def test_completion_usage_is_exact(server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    assert resp.object == "text_completion" and resp.model == MODEL_NAME
    (choice,) = resp.choices
    assert choice.finish_reason == "length" and choice.text
    num_prompt = len(_engine(server).encode_prompt(PROMPTS[0]))
    assert resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == 24
    assert resp.usage.total_tokens == num_prompt + 24


def test_streamed_text_equals_non_streamed(client: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        full = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY).choices[0]
        texts, reasons = _stream_text(client, prompt=prompt, **GREEDY)
        assert texts == {0: full.text} and reasons == {0: full.finish_reason}
    messages = [{"role": "user", "content": "Write a haiku about queues."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY).choices[0]
    assert full.message.role == "assistant"
    assert _stream_chat(client, messages=messages, **GREEDY) == (full.message.content, full.finish_reason)


def test_server_greedy_output_equals_offline_llm(server: LiveServer, client: openai.OpenAI,
                                                 demo_model_dir) -> None:
    from inflight.runtime import LLM

    offline = LLM(demo_model_dir, **MAIN_CONFIG).generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    served = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    assert [c.text for c in sorted(served.choices, key=lambda c: c.index)] == [o.text for o in offline]
    assert served.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)


def test_token_id_prompts_match_text_prompt(server: LiveServer, client: openai.OpenAI) -> None:
    ids = _engine(server).encode_prompt(PROMPTS[1])
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **GREEDY).choices[0].text
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY).choices[0].text
    by_lists = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], **GREEDY)
    assert by_ids == by_text
    assert [c.text for c in by_lists.choices] == [by_text, by_text]


def test_n_choices_and_prompt_groups(server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, seed=7,
                                     temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    lens = [len(_engine(server).encode_prompt(p)) for p in PROMPTS[:2]]
    assert resp.usage.prompt_tokens == sum(lens)  # each prompt once, not once per choice
    assert resp.usage.completion_tokens == 4 * 8
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, seed=7,
                                      temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seed, seed+1 per choice
    texts, reasons = _stream_text(client, prompt=PROMPTS[0], n=3, max_tokens=6,
                                  extra_body={"ignore_eos": True})
    assert sorted(texts) == [0, 1, 2] and set(reasons.values()) == {"length"}
    chat = client.chat.completions.create(model=MODEL_NAME, n=2, max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_strings_cut_the_output(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY).choices[0].text
    stop = next(text[k:k + 2] for k in range(4, len(text) - 2) if text[k:k + 2].strip() and "\ufffd" not in text[:k + 2])
    expected = text[: text.find(stop)]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (expected, "stop")
    texts, reasons = _stream_text(client, prompt=PROMPTS[0], stop=stop, **GREEDY)
    assert (texts[0], reasons[0]) == (expected, "stop")


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], logprobs=3, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0.0 and 1 <= len(top) <= 4
        assert chosen >= max(top.values()) - 1e-5  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [
        c.choices[0].logprobs.token_logprobs
        for c in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], logprobs=3,
                                           stream=True, **GREEDY)
        if c.choices and c.choices[0].logprobs
    ]
    assert [x for chunk in streamed for x in chunk] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs_and_usage_chunk(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 24
    assert all(len(item.top_logprobs) == 2 for item in content)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == resp.usage.model_dump() | {
        "completion_tokens_details": None, "prompt_tokens_details": None}
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_and_priority_user(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "count"}], max_completion_tokens=3,
        user="alice", extra_body={"priority": 0, "ignore_eos": True, "min_tokens": 2, "top_k": 5,
                                   "min_p": 0.01}, top_p=0.9, seed=3)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    # This server schedules fcfs: a priority it would ignore is refused, not silently dropped.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=2, extra_body={"priority": 1})
    assert info.value.body["param"] == "priority" and "scheduler-policy priority" in info.value.body["message"]


def test_penalties_reach_the_engine(client: openai.OpenAI, demo_model_dir) -> None:
    from inflight.runtime import LLM

    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3)
    offline = LLM(demo_model_dir, **MAIN_CONFIG).generate(
        PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **penalties))[0]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0.0, max_tokens=24,
        presence_penalty=0.5, frequency_penalty=0.5, logprobs=1,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logprobs=1, **GREEDY)
    assert resp.usage.completion_tokens == 24
    assert resp.choices[0].text == offline.text
    # Logprobs come from the penalized distribution: the penalties must have moved them.
    assert resp.choices[0].logprobs.token_logprobs != plain.choices[0].logprobs.token_logprobs


def test_metrics_expose_every_contract_name(server: LiveServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    text = http("GET", f"{server.url}/metrics").text
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in CONTRACT_METRICS:
        assert name in names or f"{name}_bucket" in names, name
    values = parse_metrics(text)
    assert values[f'inflight:num_kv_blocks{{model_name="{MODEL_NAME}"}}'] == 128
    assert values[f'inflight:max_num_sequences{{model_name="{MODEL_NAME}"}}'] == 4
    assert values[f'inflight:request_success_total{{finished_reason="length",model_name="{MODEL_NAME}"}}'] >= 1


def test_one_json_log_line_per_finished_request(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="inflight.server.requests"):
        resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "inflight.server.requests"]
    (line,) = [x for x in lines if x["request_id"] == resp.id]
    assert line["prompt_tokens"] == resp.usage.prompt_tokens and line["output_tokens"] == 24
    assert line["finish_reason"] == "length" and line["ttft_s"] > 0 and line["latency_s"] >= line["ttft_s"]


def _engine(server: LiveServer):
    from inflight.runtime.server.state import STATE

    return server.app[STATE].engine.engine
