"""POST /v1/embeddings: OpenAI's embeddings API on a pooling server.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists (one
engine request per input, all in one group); ``encoding_format``: ``float`` (lists of numbers)
or ``base64`` (the little-endian float32 bytes, base64-encoded, as OpenAI sends them and its
client decodes them; the client asks for base64 unless told otherwise); ``dimensions``: a
Matryoshka truncation, only where the model declares it (``is_matryoshka`` /
``matryoshka_dimensions``), else a 400 as vLLM answers; ``user``: the fair scheduler's user;
vLLM's ``add_special_tokens`` (default true) and ``truncate_prompt_tokens`` (keep the last N
tokens; -1: the context's worth). The answer: ``{"object": "list", "data": [{"object": "embedding", "embedding", "index"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}`` plus vLLM's ``id`` and ``created``.
Knows nothing about how the engine pools.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from aiohttp import web

from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.fields import get_str
from inflight.runtime.server.pooling_api.common import (
    finish_vector,
    optional_bool,
    read_body,
    run_prompts,
    served_pooler,
)
from inflight.runtime.server.state import STATE

FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "add_special_tokens",
          "truncate_prompt_tokens")  # fmt: skip


async def embeddings(request: web.Request) -> web.Response:
    body = await read_body(request, FIELDS)
    state = request.app[STATE]
    pooler = served_pooler(state, "/v1/embeddings")
    if pooler.kind != "embed":
        raise bad_request("this server runs a sequence classifier (a reranker): use /v1/score or /v1/rerank",
                          code="wrong_task")
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = _dimensions(body.get("dimensions"), pooler.is_matryoshka, pooler.matryoshka_dimensions,
                             state.settings.model_name)  # fmt: skip
    user = get_str(body, "user")
    special = optional_bool(body, "add_special_tokens", True)
    keep = truncation(body.get("truncate_prompt_tokens"), state.engine.engine.max_model_len)
    texts, token_lists = _inputs(body["input"])
    tokenizer = state.engine.engine.tokenizer
    if texts is not None:
        token_lists = await state.in_pool(lambda: [tokenizer.encode(t, add_special_tokens=special) for t in texts])
    if keep is not None:
        token_lists = [ids[-keep:] for ids in token_lists]
    pooled = await run_prompts(request, token_lists, "input", "embd", user)
    size = len(pooled.vectors[0])
    if dimensions is not None and dimensions > size:
        raise bad_request(f"'dimensions' {dimensions} exceeds the model's embedding size {size}", "dimensions")
    data = []
    for i, vector in enumerate(pooled.vectors):
        out = finish_vector(vector, pooler, dimensions)
        value: Any = (base64.b64encode(out.astype("<f4").tobytes()).decode("ascii") if encoding == "base64"
                      else out.tolist())  # fmt: skip
        data.append({"object": "embedding", "embedding": value, "index": i})
    usage = {"prompt_tokens": pooled.num_prompt_tokens, "total_tokens": pooled.num_prompt_tokens}
    return web.json_response({"id": state.new_request_id("embd"), "object": "list", "created": int(time.time()),
                              "model": state.settings.model_name, "data": data, "usage": usage})


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]]]:
    """(texts, or None) and (token-id lists, when the input is tokens) of OpenAI's ``input``."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        texts = [value] if isinstance(value, str) else list(value)
        if not all(texts):
            raise bad_request("'input' must not hold an empty string (as OpenAI answers)", "input")
        return texts, []
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists, and not empty", "input")
    if all(_is_token(v) for v in value):
        return None, [list(value)]
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        return None, [list(v) for v in value]
    raise bad_request("'input' must be a string, a list of strings, a list of token ids or a list of non-empty "
                      "token-id lists (not a mix)", "input")


def _is_token(value: Any) -> bool:
    return type(value) is int and value >= 0


def _dimensions(value: Any, matryoshka: bool, allowed: tuple[int, ...] | None, model: str) -> int | None:
    """vLLM's rules for ``dimensions``: only a Matryoshka model, only its listed sizes."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise bad_request("'dimensions' must be a positive integer", "dimensions")
    if not matryoshka:
        raise bad_request(f'Model "{model}" does not support matryoshka representation, changing output '
                          "dimensions will lead to poor results.", "dimensions")
    if allowed is not None and value not in allowed:
        raise bad_request(f'Model "{model}" only supports {list(allowed)} matryoshka dimensions, using other '
                          "output dimensions will lead to poor results.", "dimensions")
    return value


def truncation(value: Any, max_model_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the last N tokens (-1: as many as the context takes)."""
    if value is None:
        return None
    if value == -1:
        return max_model_len - 1  # a pooled prompt is checked with one output slot
    if type(value) is not int or value < 1:
        raise bad_request("'truncate_prompt_tokens' must be a positive integer (or -1: no truncation)",
                          "truncate_prompt_tokens")
    return value
