"""Who may call what: the API key on every route that runs the tokenizer, the template or the
model; the admin key on ``/admin`` and vLLM's LoRA load and unload endpoints; and the same check on ``Expect: 100-continue``, so a
client without the key is refused before it sends its body. ``--priority-api-key`` is a second
inference key, the trusted caller's: accepted wherever the API key is, and only a request
carrying it may ask for a ``priority`` below ``--priority-floor`` (:func:`priority_refusal`; a
400, never a silent clamp). The admin key stays off the inference routes.

``/health``, ``/ready`` and ``/version`` stay open (probes carry no key). ``/metrics`` is behind
the keys where the server has them (:func:`metrics_refusal`): its prefix-cache counters and
per-tenant series are no one else's business. Keys are compared in constant time. Knows nothing
about what the routes do.
"""

from __future__ import annotations

import hmac

from aiohttp import HttpVersion11, hdrs, web

from inflight.runtime.server.errors import (
    APIError,
    admin_disabled,
    admin_unauthorized,
    bad_request,
    unauthorized,
)
from inflight.runtime.server.principal import bearer_token
from inflight.runtime.server.state import STATE, ServerSettings

# Paths that need --api-key when one is set.
KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# vLLM's LoRA endpoints: admin calls here, behind the admin key as /admin is.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def refusal(request: web.Request, settings: ServerSettings) -> APIError | None:
    """The error to answer ``request`` with for a missing or wrong key, or None."""
    if request.path.startswith("/admin/") or request.path in ADMIN_PATHS:
        if settings.admin_api_key is None:
            return admin_disabled()
        if not bearer_matches(request, settings.admin_api_key):
            return admin_unauthorized()
    elif request.path == "/metrics":
        return metrics_refusal(request, settings)
    elif settings.api_key and request.path.startswith(KEYED_PREFIXES) and not (
            bearer_matches(request, settings.api_key) or is_trusted(request, settings)
            or _x_api_key_matches(request, settings.api_key) or _admin_lists_models(request, settings)):
        return unauthorized()
    return None


def _admin_lists_models(request: web.Request, settings: ServerSettings) -> bool:
    """The admin key may read ``GET /v1/models`` (the loaded LoRA adapters): the operator checks
    what its load/unload calls did with it (it never holds the inference key). Runs nothing."""
    return (request.method == "GET" and request.path == "/v1/models" and settings.admin_api_key is not None
            and bearer_matches(request, settings.admin_api_key))


def metrics_refusal(request: web.Request, settings: ServerSettings) -> APIError | None:
    """The 401 for ``GET /metrics`` without a key that may read it, or None. With
    ``--metrics-api-key``: that key or the admin key. Else, on a server with an inference key:
    any of its keys (inference, priority, admin). Else (no inference key, so anyone may call
    the API), or with ``--open-metrics``: anyone."""
    if settings.open_metrics:
        return None
    if settings.metrics_api_key is not None:
        readers = (settings.metrics_api_key, settings.admin_api_key)
    elif settings.api_key or settings.priority_api_key:
        readers = (settings.api_key, settings.priority_api_key, settings.admin_api_key)
    else:
        return None
    if any(key and bearer_matches(request, key) for key in readers):
        return None
    return APIError(401, "GET /metrics needs 'Authorization: Bearer <key>' with the server's --metrics-api-key "
                         "(or its --admin-api-key; without a metrics key, its --api-key)",
                    "authentication_error", code="invalid_api_key")


def is_trusted(request: web.Request, settings: ServerSettings) -> bool:
    """Whether ``request`` carries ``--priority-api-key`` (the trusted caller's inference key)."""
    return settings.priority_api_key is not None and bearer_matches(request, settings.priority_api_key)


def priority_refusal(request: web.Request, settings: ServerSettings, priority: int) -> APIError | None:
    """The 400 for a ``priority`` below ``settings.priority_floor`` (more urgent than untrusted
    callers may ask for) from a request without ``--priority-api-key``, or None."""
    floor = settings.priority_floor
    if floor is None or priority >= floor or is_trusted(request, settings):
        return None
    return bad_request(
        f"'priority' {priority} is more urgent than this server allows: lower values are served first, and "
        f"requests not authenticated with its --priority-api-key may ask for {floor} or higher "
        f"(--priority-floor)", "priority", code="priority_not_allowed")


def _x_api_key_matches(request: web.Request, key: str) -> bool:
    """Anthropic's ``x-api-key: <key>`` (its clients send the key there), compared in constant time."""
    sent = request.headers.get("x-api-key")
    if sent is None:
        return False
    try:
        return hmac.compare_digest(sent.encode("utf-8"), key.encode("utf-8"))
    except UnicodeEncodeError:
        return False


def bearer_matches(request: web.Request, key: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <key>`` (parsed as
    :func:`principal.bearer_token` parses it); any odd header is a mismatch."""
    token = bearer_token(request)
    if token is None:
        return False
    try:
        sent = token.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in the header (surrogate escapes)
        return False
    return hmac.compare_digest(sent, key.encode("utf-8"))


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: refuse a request without its key before the body is sent;
    otherwise answer 100 as aiohttp does (417 for any other expectation)."""
    error = refusal(request, request.app[STATE].settings)
    if error is not None:
        return error.to_response()
    if request.version == HttpVersion11:
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            return web.Response(status=417, text="only 'Expect: 100-continue' is supported")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    return None
