"""POST /tokenize and POST /detokenize (vLLM's shapes), for clients that count or inspect tokens.

``/tokenize`` takes ``{"prompt": str}`` (``add_special_tokens``, default true) or chat
``{"messages": [...]}`` rendered exactly as chat completions render it (``add_generation_prompt``,
``continue_final_message``, ``add_special_tokens`` default false, ``tools``,
``chat_template_kwargs``) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs``: each token as the tokenizer spells it, with ``return_token_strs: true``; else
null); ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``.
Parsing the messages and tokenizing run off the event loop. Knows nothing about the engine beyond its tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from inflight.runtime.server import auth
from inflight.runtime.server.errors import APIError, bad_request, too_large_to_process
from inflight.runtime.server.lora import resolve_model
from inflight.runtime.server.openai import chat_images
from inflight.runtime.server.openai.protocol import parse_chat_request
from inflight.runtime.server.state import STATE

MAX_DETOKENIZE_TOKENS = 1 << 20
# The chat-completion fields that shape a /tokenize of messages (the rest of a chat body is
# irrelevant here); the unsupported ones among them are refused as chat completions refuse them.
_CHAT_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                "add_special_tokens", "chat_template", "documents")


async def _body(request: web.Request) -> dict[str, Any]:
    from inflight.runtime.server.openai.api import read_json

    state = request.app[STATE]
    body = await read_json(request, state.settings.max_body_bytes, offload=state.in_pool)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    resolve_model(model, state.settings.model_name, state.engine.loras)  # an adapter shares the tokenizer
    return body


def _flag(body: dict[str, Any], name: str, default: bool = True) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


async def tokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    engine = request.app[STATE].engine.engine
    tokenizer = engine.tokenizer
    want_strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        chat = {"messages": body["messages"], **{k: body[k] for k in _CHAT_FIELDS if k in body}}
        try:  # on the worker pool: parsing checks every history tool call's arguments (issue 46)
            req = await request.app[STATE].in_pool(lambda: parse_chat_request(chat))
        except MemoryError:
            raise too_large_to_process("the messages", "messages") from None

        def run() -> Any:  # a chat's images count their expanded tokens (chat_images.py)
            state = request.app[STATE]
            return chat_images.render_with_images(tokenizer, req, state.settings.media_limits,
                                                  state.settings.model_name)[1]
    elif isinstance(body.get("prompt"), str):
        prompt, special = body["prompt"], _flag(body, "add_special_tokens")

        def run() -> Any:
            return tokenizer.encode(prompt, add_special_tokens=special)
    else:
        raise bad_request("send 'prompt' (a string) or 'messages' (a chat)", "prompt")
    try:
        ids = await asyncio.to_thread(run)
    except APIError:
        raise
    except MemoryError:
        raise too_large_to_process("the text to tokenize", "messages" if "messages" in body else "prompt") from None
    except Exception as exc:  # the chat template's own checks
        raise bad_request(f"could not tokenize: {exc}", "messages" if "messages" in body else "prompt") from None
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    tokens = [int(t) for t in ids]
    strs = list(await asyncio.to_thread(tokenizer.convert_ids_to_tokens, tokens)) if want_strs else None
    return web.json_response({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    engine = request.app[STATE].engine.engine
    tokens = body.get("tokens")
    vocab = engine.vocab_size
    if (not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE_TOKENS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize, expect_handler=auth.expect_continue)
    app.router.add_post("/detokenize", detokenize, expect_handler=auth.expect_continue)
