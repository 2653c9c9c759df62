"""The /v1/responses routes: ``POST /v1/responses`` and, with the store on, ``GET /v1/responses/{id}``.

Owns looking up ``previous_response_id`` (a 400 when the store is off or the id is unknown),
handing the translated chat body to the chat pipeline with a :class:`~.render.ResponsesRenderer`,
and naming the Responses fields in errors the chat checks raise (``messages`` is ``input``,
``max_tokens`` is ``max_output_tokens``...). Errors keep OpenAI's shape, which this API shares.
"""

from __future__ import annotations

from aiohttp import web

from inflight.runtime.sampling_params import brief
from inflight.runtime.server import auth
from inflight.runtime.server.errors import APIError, bad_request, not_found
from inflight.runtime.server.lora import answered_model
from inflight.runtime.server.openai import api as openai_api
from inflight.runtime.server.openai.known_fields import record_ignored
from inflight.runtime.server.responses_api.render import ResponsesRenderer
from inflight.runtime.server.responses_api.request import translate
from inflight.runtime.server.responses_api.store import ResponseStore
from inflight.runtime.server.state import STATE

STORE = web.AppKey("inflight_responses_store", ResponseStore)
STORE_OFF = "this server keeps no responses: start it with --enable-responses-store"
# Chat fields as the Responses API names them.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format"}


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body, size = await openai_api.read_body(request)
    store = request.app.get(STORE)
    previous = None
    previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous_id is not None:
        if store is None:
            raise bad_request(f"'previous_response_id' needs stored responses; {STORE_OFF}", "previous_response_id")
        stored = store.get(previous_id) if isinstance(previous_id, str) else None
        if stored is None:
            raise bad_request(f"Previous response with id {brief(previous_id)} not found (never stored, or evicted: "
                              f"this server keeps the last {store.max_entries})", "previous_response_id",
                              code="previous_response_not_found")
        previous = list(stored.items)
    translated = translate(body, previous, store is not None, state.settings.request_policy.reject_unknown_fields)
    record_ignored(request, translated.ignored)
    on_done = None
    if translated.store and store is not None:
        def on_done(response: dict) -> None:
            store.put(response, translated.items)
    model = answered_model(translated.chat_body.get("model"), state.settings.model_name, state.engine.loras)
    renderer = ResponsesRenderer(translated.echo, model, on_done)
    try:
        return await openai_api.run_chat(request, translated.chat_body, size, "resp", renderer)
    except APIError as exc:
        exc.param = PARAMS.get(exc.param or "", exc.param)
        raise


async def retrieve(request: web.Request) -> web.Response:
    store = request.app.get(STORE)
    if store is None:
        raise not_found(f"no stored response: {STORE_OFF}", code="store_disabled")
    stored = store.get(request.match_info["response_id"])
    if stored is None:
        raise not_found(f"no stored response with id {brief(request.match_info['response_id'])} (never stored, or "
                        f"evicted: this server keeps the last {store.max_entries})")
    return web.json_response(stored.response)


def add_routes(app: web.Application) -> None:
    size = app[STATE].settings.responses_store_size
    if size > 0:
        app[STORE] = ResponseStore(size)
    app.router.add_post("/v1/responses", create, expect_handler=auth.expect_continue)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
