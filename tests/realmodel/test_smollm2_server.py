"""SmolLM2-135M-Instruct through a real ``inflight serve`` process: right answers, day-one endpoints.

A fixed set of factual questions is asked concurrently over the chat API (greedy) and each
answer must contain the expected word. The same process answers /version and /v1/models,
gives 404 ``model_not_found`` for another model name, and logs the periodic stats line while
busy (interval shortened to 1 s by the fixture). Serving the ``.gguf`` file directly converts
it into the cache once and answers the same.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inflight import __version__
from inflight.runtime.model.gguf_smollm2 import SERVED_NAME
from tests.realmodel.helpers import FACTS, ServerProcess, http_json


def _ask(url: str, question: str, max_tokens: int = 24) -> str:
    status, body = http_json(f"{url}/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0,
    })
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_factual_questions_are_answered_correctly(smollm2_server: ServerProcess) -> None:
    with ThreadPoolExecutor(len(FACTS)) as pool:
        answers = list(pool.map(lambda fact: _ask(smollm2_server.url, fact[0]), FACTS))
    wrong = [(q, a) for (q, word), a in zip(FACTS, answers, strict=True) if word.lower() not in a.lower()]
    assert not wrong, wrong
    # The stats line for this work comes at the next 1 s tick, which may follow the answers.
    deadline = time.monotonic() + 5
    while "inflight.stats" not in smollm2_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "inflight.stats" in smollm2_server.log() and "generation" in smollm2_server.log()


def test_version_models_and_unknown_model(smollm2_server: ServerProcess) -> None:
    assert http_json(f"{smollm2_server.url}/version") == (200, {"version": __version__})
    status, body = http_json(f"{smollm2_server.url}/v1/models")
    assert status == 200 and body["data"][0]["id"] == SERVED_NAME and body["data"][0]["max_model_len"] == 2048
    status, body = http_json(f"{smollm2_server.url}/v1/completions", {"model": "gpt-4o", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_serving_the_gguf_file_converts_once_and_answers(smollm2_gguf: Path, tmp_path: Path) -> None:
    env = {"INFLIGHT_CACHE_DIR": str(tmp_path)}
    args = [str(smollm2_gguf), "--served-model-name", SERVED_NAME, "--num-kv-blocks", "64",
            "--max-model-len", "512", "--max-num-seqs", "2"]
    for run in range(2):
        server = ServerProcess(args, env=env).start()
        try:
            assert "Paris" in _ask(server.url, "What is the capital of France?", 12)
            converting = f"converting {smollm2_gguf.name}:" in server.log()
            assert converting == (run == 0), server.log()
        finally:
            server.stop()
    converted = [p for p in (tmp_path / "gguf").iterdir() if not p.name.startswith(".")]  # not its lock
    assert len(converted) == 1, converted


def test_openai_client_continues_an_assistant_prefix_and_retrieves_the_model(smollm2_server: ServerProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with_prefix = client.chat.completions.create(
        model=SERVED_NAME, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    text = with_prefix.choices[0].message.content
    assert "Paris" in text and not text.startswith("The capital"), text  # continued, not restarted
    tokenized = http_json(f"{smollm2_server.url}/tokenize", {
        "model": SERVED_NAME, "continue_final_message": True, "add_generation_prompt": False,
        "return_token_strs": True,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
    assert tokenized[0] == 200
    assert tokenized[1]["token_strs"][-1].endswith("Hello"), tokenized[1]["token_strs"][-4:]  # the turn stays open
