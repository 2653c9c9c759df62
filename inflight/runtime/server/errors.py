"""OpenAI-shaped HTTP errors: one exception type the handlers raise and one JSON body shape.

Owns the mapping from failure kinds to HTTP status, OpenAI ``type`` and ``code`` so every
route reports errors the same way: ``{"error": {"message", "type", "param", "code"}}``.
Knows nothing about the engine or aiohttp routing; ``app.py`` turns ``APIError`` into a
response and anything else into a 500 without a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiohttp import web

from inflight.runtime.outputs import RequestRejectedError

RETRY_AFTER_QUEUE_FULL_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5
MAX_MESSAGE_CHARS = 1000  # an error never echoes megabytes of the input back
# Engine rejection reasons that keep their own label in request_rejected_total; every other
# 400 counts as "invalid_request".
REJECTION_REASONS = ("prompt_too_long", "too_large_for_cache", "queue_full", "draining")


@dataclass(slots=True)
class APIError(Exception):
    """A failure to report to the client as an OpenAI error body."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        message = self.message
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 15] + "... (truncated)"
        return {
            "error": {
                "message": message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer <key>' with the server's --api-key",
        "authentication_error",
        code="invalid_api_key",
    )


def admin_unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong admin key: send 'Authorization: Bearer <key>' with the server's "
        "--admin-api-key (the inference --api-key does not grant admin)",
        "authentication_error",
        code="invalid_admin_key",
    )


def admin_disabled() -> APIError:
    return APIError(
        404,
        "the admin API is off on this server; start it with --admin-api-key "
        "(or env INFLIGHT_ADMIN_API_KEY) to enable /admin",
        "not_found_error",
        code="admin_disabled",
    )


def request_timeout(seconds: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {seconds:g} s",
        "invalid_request_error",
        code="request_timeout",
    )


def rejection_reason(error: APIError) -> str | None:
    """The ``request_rejected_total`` label of a refused generation request, or ``None``."""
    if error.code in REJECTION_REASONS:
        return error.code
    if 400 <= error.status < 500 and error.status not in (401, 403, 404):
        return "invalid_request"
    return None


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, code)


def body_too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than {max_bytes} bytes; send a shorter prompt",
        "invalid_request_error",
        code="request_too_large",
    )


def too_large_to_process(what: str, param: str | None = None) -> APIError:
    """413 for client input that ran the server out of memory while it was parsed (a
    ``MemoryError``): the client's input is the cause, so it is the client's error, not a 500."""
    return APIError(
        413,
        f"{what} is too large to process in the memory this server has; send less",
        "invalid_request_error",
        param,
        code="request_too_large",
    )


def queue_full(message: str) -> APIError:
    return APIError(
        429,
        message,
        "rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)},
    )


def engine_dead(reason: object = None) -> APIError:
    """503 ``engine_dead``: the one answer once the engine has died (the server is exiting)."""
    because = f" ({reason})" if reason else ""
    return unavailable(f"the engine has stopped{because}; the server is exiting, retry on another replica",
                       "engine_dead")


def unavailable(message: str, code: str) -> APIError:
    return APIError(
        503,
        message,
        "service_unavailable_error",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
    )


def internal_error() -> APIError:
    return APIError(
        500,
        "internal server error; the server log has the details",
        "server_error",
        code="internal_error",
    )


def from_rejection(exc: RequestRejectedError, default_param: str | None) -> APIError:
    """The HTTP error for an engine rejection: 429 when the queue is full, 404 for a LoRA adapter
    unloaded since the request named it, else 400."""
    if exc.reason == "queue_full":
        return queue_full(str(exc))
    if exc.reason == "model_not_found":
        return APIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    return bad_request(str(exc), exc.param or default_param, code=exc.reason)
