"""The chat client: streaming OpenAI ``/v1/chat/completions`` requests, timed, text kept.

Owns one streaming greedy chat request (:func:`stream_chat`: time to first token, the gaps
between content chunks, the end-to-end latency, the text, and the token counts from the
``usage`` chunk or, failing that, llama.cpp's ``timings``) and sending a list of them all at
once or one after another (:func:`chat`). Errors are recorded on the result, never raised.
Knows nothing about which server it talks to or how results are summarized; the plain
completions client is :mod:`inflight.bench.client`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from inflight.bench.client import RequestResult

REQUEST_TIMEOUT_S = 900.0


@dataclass(slots=True)
class ChatResult:
    result: RequestResult
    text: str = ""
    num_chunks: int = 0  # streamed chunks with content (about one per token)


def chat_body(question: str, max_tokens: int, model: str = "bench") -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` (``ignore_eos`` is understood by inflight and llama.cpp)."""
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _take_counts(event: Mapping[str, Any], result: RequestResult) -> None:
    usage, timings = event.get("usage"), event.get("timings")
    if usage:
        result.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.num_output_tokens = int(usage.get("completion_tokens") or 0)
    elif timings and not result.num_output_tokens:  # llama.cpp without a usage chunk
        result.num_prompt_tokens = int(timings.get("prompt_n") or 0)
        result.num_output_tokens = int(timings.get("predicted_n") or 0)


async def stream_chat(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> ChatResult:
    """One streaming chat completion; errors are recorded, never raised."""
    out, sent, last = ChatResult(RequestResult()), time.perf_counter(), None
    result = out.result
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event, now = json.loads(line[5:]), time.perf_counter()
                text = "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())
                if text:
                    out.text += text
                    out.num_chunks += 1
                    if result.ttft_s is None:
                        result.ttft_s = now - sent
                    elif last is not None:
                        result.gaps_s.append(now - last)
                    last = now
                _take_counts(event, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return out
    result.e2e_s = time.perf_counter() - sent
    if result.ttft_s is None or not result.num_output_tokens:
        result.error = "no tokens or no token count in the stream"
    return out


async def send_chats(url: str, bodies: Sequence[Mapping[str, Any]], at_once: bool,
                     timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[list[ChatResult], float]:
    """Stream ``bodies`` to ``url`` at once or one after another; results and wall seconds."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # force_close: one connection per request (llama-server closes a kept-alive one after a stream)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        if at_once:
            results = list(await asyncio.gather(*(stream_chat(session, url, b) for b in bodies)))
        else:
            results = [await stream_chat(session, url, b) for b in bodies]
        return results, time.perf_counter() - start


def chat(url: str, bodies: Sequence[Mapping[str, Any]], at_once: bool,
         timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[list[ChatResult], float]:
    """Send ``bodies`` all at once (a burst) or one after another (batch 1); results and wall s."""
    return asyncio.run(send_chats(url, bodies, at_once, timeout_s))
