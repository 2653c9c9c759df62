"""The admin endpoint: GET/POST /admin/config, the live engine config and live retuning.

Owns the admin JSON shape: GET returns the live ``EngineConfig`` (snake_case names, plus
``resolved``: the device, dtype and kernel backend ``auto`` chose); POST
takes an object of any of ``LIVE_TUNABLE_FIELDS`` and applies it on the engine thread via
``engine.update_config``. Other fields or bad values (outside ``EngineConfig``'s ranges, e.g. a
400-digit integer) are 400 OpenAI errors naming the field and the range. Authentication
is the app's middleware (the separate --admin-api-key; /admin is off without one). Knows nothing about the OpenAI generation API.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig
from inflight.runtime.sampling_params import brief
from inflight.runtime.server import auth
from inflight.runtime.server.errors import bad_request, unavailable
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


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/config", get_config)
    app.router.add_post("/admin/config", post_config, expect_handler=auth.expect_continue)
