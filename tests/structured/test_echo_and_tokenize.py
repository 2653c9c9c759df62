"""Completions for evaluators: echo (text and legacy logprobs, the way lm-evaluation-harness's
local-completions scores loglikelihoods), vLLM's prompt_logprobs, logit_bias, and the
/tokenize and /detokenize endpoints."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.server.server_helpers import MODEL_NAME, client_for

PROMPT = "import os\nimport sys\n\ndef main():"


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _offline_prompt_logprobs(server, ids: list[int]) -> list[float]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(server.model_dir), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(llama_server) -> None:
    """lm-eval sends token ids, echo=True, logprobs=1, max_tokens=1, temperature=0 and reads
    token_logprobs[ctxlen:-1]: those must be transformers' own log-probabilities."""
    tok = llama_server.engine.tokenizer
    context, continuation = tok.encode("def add(a, b):"), tok.encode(" return a + b", add_special_tokens=False)
    ids = context + continuation
    _, body = _post(llama_server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": [ids, context], "echo": True, "logprobs": 1, "max_tokens": 1,
        "temperature": 0})
    choices = sorted(body["choices"], key=lambda c: c["index"])
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _offline_prompt_logprobs(llama_server, ids)
    got = lp["token_logprobs"][len(context):-1]
    assert len(got) == len(continuation)
    assert max(abs(g - w) for g, w in zip(got, want[len(context) - 1:], strict=True)) < 1e-4
    for token_lp, top in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1], strict=True):
        assert len(top) >= 1 and max(top.values()) >= token_lp - 1e-6
    assert choices[0]["text"].startswith(tok.decode(ids))
    assert len(choices[1]["logprobs"]["tokens"]) == len(context) + 1


def test_echo_text_and_prompt_logprobs(llama_server) -> None:
    client = client_for(llama_server)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    ids = llama_server.engine.encode_prompt(PROMPT)
    assert plp[0] is None and len(plp) == len(ids)
    want = _offline_prompt_logprobs(llama_server, ids)
    for i, entry in enumerate(plp[1:], start=1):
        assert abs(entry[str(ids[i])]["logprob"] - want[i - 1]) < 1e-4
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None)[:2] == [1, 2]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_logit_bias_steers_and_bans(llama_server) -> None:
    client = client_for(llama_server)
    target = llama_server.engine.tokenizer.encode("x", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(target): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == ["x"] * 5
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    first = llama_server.engine.tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100}, logprobs=0)
    assert llama_server.engine.tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "stream": True}, "echo"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"suffix": "x"}, "suffix"),
])
def test_completion_fields_refused_by_name(llama_server, body: dict, param: str) -> None:
    status, err = _post(llama_server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_best_of_equal_to_n_is_accepted(llama_server) -> None:
    out = client_for(llama_server).completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=2, best_of=2)
    assert len(out.choices) == 2


def test_best_of_returns_the_most_likely_candidates(llama_server) -> None:
    """best_of=6, n=2 on two prompts: each prompt's two kept choices are the two candidates
    (out of the same six seeded draws, seen with n=6) with the highest total logprob."""
    client = client_for(llama_server)
    prompts = ["def f(x):", "import re"]
    common = dict(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=1.0, seed=5)
    every = client.completions.create(n=6, logprobs=0, **common)
    best = client.completions.create(n=2, best_of=6, **common)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in best.choices)
    for p in range(2):
        candidates = sorted(every.choices[p * 6:(p + 1) * 6], key=lambda c: -sum(c.logprobs.token_logprobs))
        assert [c.text for c in best.choices[p * 2:(p + 1) * 2]] == [c.text for c in candidates[:2]]
    assert best.usage.completion_tokens == every.usage.completion_tokens
    with_lp = client.completions.create(n=1, best_of=3, logprobs=1, **common).choices[0]
    assert with_lp.logprobs is not None and len(with_lp.logprobs.tokens) == 6


def test_tokenize_and_detokenize(qwen3_server) -> None:
    tok = qwen3_server.engine.tokenizer
    status, body = _post(qwen3_server, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert status == 200 and body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == qwen3_server.engine.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    _, chat = _post(qwen3_server, "/tokenize", {"messages": messages,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, enable_thinking=False)
    _, text = _post(qwen3_server, "/detokenize", {"tokens": body["tokens"]})
    assert text["prompt"] == tok.decode(body["tokens"])
    status, err = _post(qwen3_server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = _post(qwen3_server, "/tokenize", {"model": "other", "prompt": "x"})
    assert status in (400, 404) and err["error"]["param"] == "model"
