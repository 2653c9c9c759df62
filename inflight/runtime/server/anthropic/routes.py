"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Owns handing the translated chat body to the chat pipeline with a
:class:`~.render.MessagesRenderer`, and Anthropic's error shape for every failure under
``/v1/messages`` (``{"type": "error", "error": {"type", "message"}}``), those of the app's
middlewares included (a missing key, a server still loading): :func:`add_routes` puts
:func:`anthropic_errors` outermost, where it rewrites the OpenAI-shaped error bodies. The
``anthropic-version`` header is accepted (any version: the shapes served are the current ones);
``x-api-key`` is the API key where the server has one (``server.auth``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from inflight.runtime.server import auth
from inflight.runtime.server.anthropic.render import MessagesRenderer, error_body
from inflight.runtime.server.anthropic.request import translate
from inflight.runtime.server.lora import answered_model
from inflight.runtime.server.openai import api as openai_api
from inflight.runtime.server.openai.known_fields import record_ignored
from inflight.runtime.server.state import STATE

PREFIX = "/v1/messages"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body, size = await openai_api.read_body(request)
    chat, ignored = translate(body, state.settings.request_policy.reject_unknown_fields)
    record_ignored(request, ignored)
    model = answered_model(chat.get("model"), state.settings.model_name, state.engine.loras)
    renderer = MessagesRenderer(model, chat.get("stop", ()))
    return await openai_api.run_chat(request, chat, size, "msg", renderer)


async def count_tokens(request: web.Request) -> web.Response:
    body, size = await openai_api.read_body(request)
    if isinstance(body, dict):  # count_tokens takes no max_tokens
        body = {**body, "max_tokens": 1}
        body.pop("stream", None)
    chat, ignored = translate(body, request.app[STATE].settings.request_policy.reject_unknown_fields)
    record_ignored(request, ignored)
    return web.json_response({"input_tokens": await openai_api.count_chat_tokens(request, chat, size)})


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Under /v1/messages: an error answer (OpenAI-shaped by the app) in Anthropic's shape."""
    response = await handler(request)
    if not request.path.startswith(PREFIX) or response.status < 400 or not isinstance(response, web.Response) \
            or response.body is None or response.content_type != "application/json":
        return response
    try:
        error = json.loads(response.text or "")["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "x-request-id")}
    return web.json_response(error_body(response.status, message), status=response.status, headers=headers)


def add_routes(app: web.Application) -> None:
    app.middlewares.insert(0, anthropic_errors)
    app.router.add_post(PREFIX, create, expect_handler=auth.expect_continue)
    app.router.add_post(f"{PREFIX}/count_tokens", count_tokens, expect_handler=auth.expect_continue)
