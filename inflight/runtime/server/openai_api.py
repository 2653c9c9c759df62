"""The OpenAI routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Owns reading the JSON body (400 malformed, 413 too large), checking the model name, and
turning prompts or chat messages into token ids (the tokenizer's chat template with the
generation prompt). Hands the rest to ``generation``. Knows nothing about the engine
thread, metrics names or the server lifecycle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.server import generation
from inflight.runtime.server.errors import bad_request, body_too_large, from_rejection
from inflight.runtime.server.protocol import (
    GenerationRequest,
    check_model,
    parse_chat_request,
    parse_completion_request,
)
from inflight.runtime.server.state import STATE, ServerState


async def read_json(request: web.Request, max_bytes: int) -> Any:
    """The request body as JSON: 413 past ``max_bytes``, 400 when it is not JSON."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    if len(raw) > max_bytes:
        raise body_too_large(max_bytes)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion_request(await read_json(request, state.settings.max_body_bytes))
    check_model(req.model, state.settings.model_name)
    engine = state.engine.engine
    try:
        prompt_ids = [engine.encode_prompt(p) if isinstance(p, str) else list(p) for p in req.prompts]
    except RequestRejectedError as exc:
        raise from_rejection(exc, "prompt") from None
    job = generation.plan(state, req, prompt_ids, "cmpl")
    return await generation.run(request, state, job)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat_request(await read_json(request, state.settings.max_body_bytes))
    check_model(req.model, state.settings.model_name)
    prompt_ids = [_apply_chat_template(state, req)]
    job = generation.plan(state, req, prompt_ids, "chatcmpl")
    return await generation.run(request, state, job)


def _apply_chat_template(state: ServerState, req: GenerationRequest) -> list[int]:
    tokenizer = state.engine.engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(
            "this model's tokenizer has no chat template; use /v1/completions", "messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            list(req.messages or ()), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # the template's own checks (e.g. role order) raise
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return _as_ids(ids)


def _as_ids(ids: Sequence[Any]) -> list[int]:
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(t) for t in ids]


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine.engine if state.engine.is_ready else None
    card: dict[str, Any] = {
        "id": state.settings.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "inflight",
    }
    if engine is not None:
        card["max_model_len"] = engine.max_model_len
    return web.json_response({"object": "list", "data": [card]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
