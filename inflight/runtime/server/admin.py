"""The admin endpoints: GET/POST /admin/config (the live engine config and live retuning) and
vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns the admin JSON shape: GET returns the live ``EngineConfig`` (snake_case names, plus
``resolved``: the device, dtype and kernel backend ``auto`` chose); POST
takes an object of any of ``LIVE_TUNABLE_FIELDS`` and applies it on the engine thread via
``engine.update_config``. Other fields or bad values (outside ``EngineConfig``'s ranges, e.g. a
400-digit integer) are 400 OpenAI errors naming the field and the range. Authentication
is the app's middleware (the separate --admin-api-key; /admin is off without one). Knows nothing about the OpenAI generation API.

The LoRA endpoints take vLLM's bodies (``{"lora_name", "lora_path"}``; ``{"lora_name"}``) and answer
200 with vLLM's plain-text success line; 400 when LoRA is off (``--enable-lora``), for a bad body,
or for an adapter the engine refused (its reason: bad files, rank over ``--max-lora-rank``, an
unknown target module, shapes that do not fit the model, a name loaded from another path); 404
for unloading a name that is not loaded. Behind the admin key like /admin (``auth``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig
from inflight.runtime.lora.types import LoRAError, UnknownLoRA
from inflight.runtime.sampling_params import brief
from inflight.runtime.server import auth
from inflight.runtime.server.errors import APIError, bad_request, not_found, unavailable
from inflight.runtime.server.lora import lora_name_problem
from inflight.runtime.server.openai.api import read_json
from inflight.runtime.server.state import STATE

logger = logging.getLogger("inflight.server.admin")


async def get_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.is_ready:
        raise unavailable("the model is still loading; retry shortly", "loading")
    return web.json_response(config_body(state.engine.engine, state.engine.engine.config))


async def post_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.engine.is_ready:
        raise unavailable("the model is still loading; retry shortly", "loading")
    body = await read_json(request, state.settings.max_body_bytes, state.settings.request_read_timeout_s)
    changes = validate_changes(body, state.engine.engine.config)
    if changes:
        try:
            config: EngineConfig = await state.engine.update_config(changes)
        except ValueError as exc:
            raise bad_request(str(exc), _field_in(str(exc), changes)) from None
        logger.info("live config changed: %s", changes)
    else:
        config = state.engine.engine.config
    return web.json_response(config_body(state.engine.engine, config))


def config_body(engine: Any, config: EngineConfig) -> dict[str, Any]:
    """The config's fields plus ``resolved``: what ``auto`` turned into on this machine."""
    body = config.to_dict()
    body["resolved"] = dict(engine.resolved)
    return body


def validate_changes(body: object, current: EngineConfig) -> dict[str, int]:
    """The requested live changes, or a 400 naming the field that cannot be changed or the
    value out of its range (``EngineConfig``'s own bounds, checked on ``current`` before the
    engine sees the change: the live config stays as it was)."""
    if not isinstance(body, dict):
        raise bad_request(
            f"the body must be a JSON object with any of: {', '.join(LIVE_TUNABLE_FIELDS)}"
        )
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for name, value in body.items():
        if name not in known:
            raise bad_request(
                f"unknown field '{name}'; live fields: {', '.join(LIVE_TUNABLE_FIELDS)}", name
            )
        if name not in LIVE_TUNABLE_FIELDS:
            raise bad_request(
                f"'{name}' cannot be changed while running; live fields: "
                f"{', '.join(LIVE_TUNABLE_FIELDS)} (restart with a flag for the others)",
                name,
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"'{name}' must be an integer (got {brief(value)})", name)
    try:
        current.replace(**body)
    except ValueError as exc:
        raise bad_request(str(exc), _field_in(str(exc), body)) from None
    return dict(body)


def _field_in(message: str, changes: dict[str, int]) -> str | None:
    return next((name for name in changes if name in message), None)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter ``{"lora_name", "lora_path"}`` (vLLM's)."""
    state = request.app[STATE]
    body = await _lora_body(request, ("lora_name", "lora_path", "load_inplace"))
    name, path = body.get("lora_name"), body.get("lora_path")
    problem = lora_name_problem(name)
    if problem:
        raise bad_request(problem, "lora_name")
    if name == state.settings.model_name:
        raise bad_request(f"'{name}' is the served model's name; give the adapter another", "lora_name")
    if not isinstance(path, str) or not path:
        raise bad_request("'lora_path' must be the adapter's directory (a non-empty string)", "lora_path")
    if body.get("load_inplace", False) is not False:
        raise bad_request("'load_inplace' is not supported: unload the adapter, then load it again", "load_inplace")
    try:
        info = await state.engine.load_lora(name, path)
    except LoRAError as exc:
        raise bad_request(f"LoRA adapter '{name}' refused: {exc}", "lora_path", "invalid_lora_adapter") from None
    except RuntimeError as exc:  # the engine failed otherwise (logged there); nothing was loaded
        raise APIError(500, f"loading LoRA adapter '{name}' failed: {exc}", "server_error",
                       code="lora_load_failed") from None
    logger.info("LoRA adapter %r loaded from %s (rank %d)", info.name, info.path, info.rank)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter ``{"lora_name"}`` (vLLM's; its ``lora_int_id`` is ignored)."""
    state = request.app[STATE]
    body = await _lora_body(request, ("lora_name", "lora_int_id"))
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("'lora_name' must be the name of a loaded adapter", "lora_name")
    try:
        await state.engine.unload_lora(name)
    except UnknownLoRA:
        raise not_found(f"The lora adapter '{name}' cannot be found (GET /v1/models lists those loaded).",
                        "lora_name", "lora_adapter_not_found") from None
    logger.info("LoRA adapter %r unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_body(request: web.Request, fields: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object of a LoRA call (400 for another shape or field), once LoRA is known to be on."""
    state = request.app[STATE]
    if not state.engine.engine.config.enable_lora:
        raise bad_request("LoRA adapters are not enabled on this server; start it with --enable-lora",
                          code="lora_not_enabled")
    body = await read_json(request, state.settings.max_body_bytes, state.settings.request_read_timeout_s)
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object with {', '.join(repr(f) for f in fields[:2])}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(f"unknown field '{brief(unknown[0])}'; the fields are {', '.join(fields)}", unknown[0])
    return body


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/config", get_config)
    app.router.add_post("/admin/config", post_config, expect_handler=auth.expect_continue)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter, expect_handler=auth.expect_continue)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter, expect_handler=auth.expect_continue)
