"""The official ``openai`` client against a served model: a chat, the same chat streamed, models.retrieve.

``python -m bench.compat.openai_run --base-url URL --model NAME`` prints one JSON list of
checks (``check``, ``ok``, ``result``). ``make compat`` runs it with the python of the openai
client's own environment (this checkout on ``PYTHONPATH``), so it imports nothing but the
standard library and ``openai``. Greedy decoding makes the streamed text a check of its own:
it must equal the text of the plain call.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

QUESTION = "What is the capital of France?"
MAX_TOKENS = 32


def _check(name: str, ok: bool, result: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "result": result}


def run_checks(base_url: str, model: str) -> list[dict[str, Any]]:
    """The three checks; an exception in one is that check's failure, not the run's."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    checks, text = [], None
    try:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        text = reply.choices[0].message.content or ""
        checks.append(_check("chat.completions.create", bool(text) and reply.usage is not None,
                             f"{text!r} ({reply.usage.completion_tokens if reply.usage else '?'} tokens, "
                             f"finish_reason {reply.choices[0].finish_reason})"))
    except Exception as exc:  # noqa: BLE001 - reported as the check's result
        checks.append(_check("chat.completions.create", False, f"{type(exc).__name__}: {exc}"))
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
        streamed = "".join(parts)
        same = "same text as the plain call" if streamed == text else f"differs from the plain call: {streamed!r}"
        checks.append(_check("chat.completions.create(stream=True)", bool(streamed) and streamed == text,
                             f"{sum(1 for p in parts if p)} content chunks, {same}"))
    except Exception as exc:  # noqa: BLE001
        checks.append(_check("chat.completions.create(stream=True)", False, f"{type(exc).__name__}: {exc}"))
    try:
        got = client.models.retrieve(model)
        checks.append(_check("models.retrieve", got.id == model, f"id {got.id!r}, owned_by {got.owned_by!r}"))
    except Exception as exc:  # noqa: BLE001
        checks.append(_check("models.retrieve", False, f"{type(exc).__name__}: {exc}"))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compat.openai_run", description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    args = parser.parse_args(argv)
    import openai

    print(json.dumps({"openai_version": openai.__version__, "checks": run_checks(args.base_url, args.model)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
