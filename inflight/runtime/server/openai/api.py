"""The OpenAI routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models and
GET /v1/models/{id}.

Owns reading the JSON body (400 malformed in any way: bad JSON, bad encoding, bad
compression, nesting past ``MAX_JSON_DEPTH``, integers past Python's digit limit, strings
that are not valid Unicode; 413 too large, or too large to parse in the memory left (a
``MemoryError`` from parsing, tokenizing or planning what a client sent is its error, never a
500); 408 too slow), checking the model name, and
turning prompts or chat messages into token ids (``chat_support.render_chat``). For a body past ``INLINE_BODY_BYTES`` the parsing, tokenizing and planning
run on the state's worker pool, so a huge prompt never blocks the event loop. Hands the rest to ``generation``. Knows nothing about the engine thread, metrics
names or the server lifecycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.server import auth
from inflight.runtime.server.cache_isolation import engine_salt
from inflight.runtime.server.errors import (
    bad_request,
    body_too_large,
    from_rejection,
    queue_full,
    request_timeout,
    too_large_to_process,
)
from inflight.runtime.server.lora import lora_cards, resolve_model
from inflight.runtime.server.openai import chat_images, chat_support, generation
from inflight.runtime.server.openai.known_fields import record_ignored
from inflight.runtime.server.openai.protocol import (
    GenerationRequest,
    RequestPolicy,
    parse_chat_request,
    parse_completion_request,
)
from inflight.runtime.server.openai.streaming import Renderer
from inflight.runtime.server.principal import principal
from inflight.runtime.server.state import STATE, ServerState

MAX_JSON_DEPTH = 64
# Bodies up to this size are parsed, tokenized and planned on the event loop (well under a
# millisecond per KiB); bigger ones go to the worker pool, so they neither block the loop nor
# make small requests queue behind them.
INLINE_BODY_BYTES = 16 * 1024
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


async def read_json(request: web.Request, max_bytes: int, timeout_s: float = 60.0,
                    offload: Offload | None = None) -> Any:
    """The request body as JSON: 413 past ``max_bytes``, 408 past ``timeout_s``, else 400
    for anything that is not a JSON document of valid Unicode nested at most ``MAX_JSON_DEPTH``.
    ``offload(fn)``: run the decoding of a body over ``INLINE_BODY_BYTES`` there (a worker
    pool), not on the event loop."""
    return (await read_json_sized(request, max_bytes, timeout_s, offload))[0]


async def read_json_sized(request: web.Request, max_bytes: int, timeout_s: float,
                          offload: Offload | None = None) -> tuple[Any, int]:
    """:func:`read_json` plus the body's size in bytes."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    except asyncio.TimeoutError:
        raise request_timeout(timeout_s) from None
    except (web.RequestPayloadError, ClientPayloadError, HttpProcessingError) as exc:  # e.g. bad gzip
        cause = exc.__cause__ or exc
        raise bad_request(f"the request body could not be read: {type(cause).__name__} "
                          f"(check Content-Encoding and Transfer-Encoding)") from None
    if len(raw) > max_bytes:
        raise body_too_large(max_bytes)
    if offload is not None and len(raw) > INLINE_BODY_BYTES:
        return await offload(lambda: _decode_json(raw)), len(raw)
    return _decode_json(raw), len(raw)


def _decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw.decode("utf-8"))  # JSON is UTF-8 (RFC 8259); json.loads(bytes) would guess
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise bad_request(f"the request body is not acceptable JSON: {str(exc)[:200]}") from None
    except MemoryError:
        raise too_large_to_process(f"the request body ({len(raw)} bytes of JSON)") from None
    _check_json_value(body)
    return body


def _check_json_value(body: Any) -> None:
    """400 for nesting deeper than ``MAX_JSON_DEPTH`` or strings with lone surrogates (which
    no tokenizer can encode), walking the document iteratively (numbers cost one type check)."""
    _check_string(body)
    stack: list[tuple[Any, int]] = [(body, 1)] if type(body) in (dict, list) else []
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        if type(value) is dict:
            for key in value:
                _check_string(key)
            value = value.values()
        for item in value:
            kind = type(item)
            if kind is str:
                _check_string(item)
            elif kind is list or kind is dict:
                stack.append((item, depth + 1))


def _check_string(value: Any) -> None:
    if type(value) is str and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request body has a string that is not valid Unicode "
                              "(a lone UTF-16 surrogate escape such as \\ud800)") from None


async def _off_loop(state: ServerState, body_bytes: int, fn: Any) -> Any:
    """``fn()`` (parsing, tokenizing, planning) inline for a small body, else on the worker
    pool (429 when too many jobs are already waiting for it)."""
    if body_bytes <= INLINE_BODY_BYTES:
        return fn()
    if state.num_tokenizing >= state.settings.max_pending_tokenizations:
        raise queue_full("too many prompts are being tokenized; retry shortly")
    return await state.in_pool(fn)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run_job(request, _completion_job)


async def _run_job(request: web.Request,
                   make_job: Callable[[web.Request, ServerState], Awaitable[generation.Job]]) -> web.StreamResponse:
    """Plan the job (a 413-style answer when what the client sent runs out of memory while it
    is parsed, templated, tokenized or planned), then run it."""
    state = request.app[STATE]
    try:
        job = await make_job(request, state)
    except MemoryError:
        raise too_large_to_process("the request") from None
    return await generation.run(request, state, job)


async def _parsed(request: web.Request, state: ServerState,
                  parse: Callable[[object, RequestPolicy], GenerationRequest]) -> tuple[GenerationRequest, int]:
    """The request body parsed off the loop, salted for the prefix cache, its model and
    priority checked; with the body's size (for the off-loop threshold)."""
    body, size = await _read_body(request, state)
    return await _checked(request, state, parse, body, size), size


async def _checked(request: web.Request, state: ServerState,
                   parse: Callable[[object, RequestPolicy], GenerationRequest], body: Any, size: int) -> GenerationRequest:
    req = await _off_loop(state, size, lambda: parse(body, state.settings.request_policy))
    record_ignored(request, req.ignored_fields)  # named in a response header, logged once per name
    salt = engine_salt(request, state.settings, req.cache_salt)
    if salt != req.cache_salt:  # a copy only when isolation salts it (frozen: each copy sets every field)
        req = dataclasses.replace(req, cache_salt=salt)
    lora_name = resolve_model(req.model, state.settings.model_name, state.engine.loras)
    _check_priority(request, state, req.priority)
    return dataclasses.replace(req, lora_name=lora_name) if lora_name is not None else req


async def _completion_job(request: web.Request, state: ServerState) -> generation.Job:
    req, size = await _parsed(request, state, parse_completion_request)
    engine = state.engine.engine

    special = req.features.add_special_tokens is not False

    def encode_all() -> list[list[int]]:
        return [_encode(engine, p, special) if isinstance(p, str) else list(p) for p in req.prompts]

    try:
        prompt_ids = await _off_loop(state, size, encode_all)
    except RequestRejectedError as exc:
        raise from_rejection(exc, "prompt") from None
    req = await chat_support.compile_constraint(engine, req, state.compile_budget, principal(request, state.settings))
    req = chat_support.expand_best_of(req)
    decorate = chat_support.body_decorator(req, engine.tokenizer, prompt_ids)
    return await _off_loop(state, size, lambda: generation.plan(state, req, prompt_ids, "cmpl", decorate=decorate))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run_job(request, _chat_job)


async def _chat_job(request: web.Request, state: ServerState) -> generation.Job:
    body, size = await _read_body(request, state)
    return await chat_job(request, state, body, size)


async def chat_job(request: web.Request, state: ServerState, body: Any, size: int, prefix: str = "chatcmpl",
                   renderer: Renderer | None = None) -> generation.Job:
    """The job of a chat completion ``body`` (``size`` bytes as sent): every check, template,
    tool and structured-output rule of /v1/chat/completions. ``renderer``: another API that
    translated its request into this body and renders the answer its own way (the seam the
    Responses and Anthropic Messages APIs use)."""
    req = await _checked(request, state, parse_chat_request, body, size)
    engine = state.engine.engine
    req, ids = await _off_loop(state, size, lambda: chat_images.render_with_images(  # images: chat_images.py
        engine.tokenizer, req, state.settings.media_limits, state.settings.model_name))
    prompt_ids = [ids]
    req = await chat_support.compile_constraint(engine, req, state.compile_budget, principal(request, state.settings))
    output = chat_support.output_plan(req, engine.tokenizer, prompt_ids[0], state.settings)
    if req.params.skip_special_tokens and chat_support.keeps_special_tokens(output, engine.tokenizer):
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, skip_special_tokens=False))
    decorate = chat_support.body_decorator(req, engine.tokenizer, prompt_ids)
    job = await _off_loop(state, size, lambda: generation.plan(
        state, req, prompt_ids, prefix, None if output.is_plain else output, decorate))
    job.renderer = renderer
    return job


async def run_chat(request: web.Request, body: Any, size: int, prefix: str, renderer: Renderer) -> web.StreamResponse:
    """Answer a chat completion ``body`` that another API translated its request into, in that
    API's shape (``renderer``)."""
    async def make_job(request: web.Request, state: ServerState) -> generation.Job:
        return await chat_job(request, state, body, size, prefix, renderer)

    return await _run_job(request, make_job)


async def count_chat_tokens(request: web.Request, body: Any, size: int) -> int:
    """How many tokens the chat ``body``'s prompt renders to (every check of a chat request but
    admission): an API's ``count_tokens``."""
    state = request.app[STATE]
    req = await _checked(request, state, parse_chat_request, body, size)
    engine = state.engine.engine
    return len((await _off_loop(state, size, lambda: chat_images.render_with_images(
        engine.tokenizer, req, state.settings.media_limits, state.settings.model_name)))[1])


async def read_body(request: web.Request) -> tuple[Any, int]:
    """The request's JSON body (bounded in size and time) and its size in bytes."""
    return await _read_body(request, request.app[STATE])


def _check_priority(request: web.Request, state: ServerState, priority: int) -> None:
    error = auth.priority_refusal(request, state.settings, priority)
    if error is not None:
        raise error


async def _read_body(request: web.Request, state: ServerState) -> tuple[Any, int]:
    return await read_json_sized(request, state.settings.max_body_bytes, state.settings.request_read_timeout_s,
                                 lambda fn: _off_loop(state, INLINE_BODY_BYTES + 1, fn))


def _encode(engine: Any, prompt: str, add_special_tokens: bool) -> list[int]:
    """A text prompt's ids: with BOS as transformers adds it, or as written (vLLM's
    ``add_special_tokens: false``)."""
    if add_special_tokens:
        return engine.encode_prompt(prompt)
    if not prompt:
        raise RequestRejectedError("prompt must not be empty", "invalid_request", "prompt")
    return list(engine.tokenizer.encode(prompt, add_special_tokens=False))


def _model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The served model's card, then one per loaded LoRA adapter (``parent``: the served model)."""
    engine = state.engine.engine if state.engine.is_ready else None
    created = int(time.time())
    card: dict[str, Any] = {
        "id": state.settings.model_name,
        "object": "model",
        "created": created,
        "owned_by": "inflight",
    }
    if engine is not None:
        card["max_model_len"] = engine.max_model_len
    parents = {m.name: m.base_model_name for m in state.settings.lora_modules}
    return [card, *lora_cards(state.engine.loras, state.settings.model_name, parents, created,
                              card.get("max_model_len"))]


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the card of the served model or a loaded adapter (as listed by GET
    /v1/models), 404 ``model_not_found`` for any other id (the openai client's ``models.retrieve``)."""
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    resolve_model(model_id, state.settings.model_name, state.engine.loras)
    return web.json_response(next(c for c in _model_cards(state) if c["id"] == model_id))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions, expect_handler=auth.expect_continue)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=auth.expect_continue)
    app.router.add_get("/v1/models", models)
    # ``.+``: a served name may hold slashes (``org/name``), sent raw or percent-encoded.
    app.router.add_get("/v1/models/{model_id:.+}", model)
