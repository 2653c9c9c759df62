"""Which tenant a request belongs to, for the ``fair`` scheduler policy: a name the client cannot mint.

A tenant is ``<group>/<user>`` (:func:`inflight.runtime.core.fairness.tenant_name`):

* the **group** is what the server itself checked: the caller's identity
  (:func:`~inflight.runtime.server.principal.principal`: ``key:<digest>`` of the API key it
  authenticated with, or ``addr:<peer>`` on a server without keys); or, with
  ``--tenant-header NAME``, that header's value, set by a trusted gateway in front (e.g. llm-d's
  ``x-gateway-inference-fairness-id``), falling back to the caller's identity when a request
  carries no such header. Groups share the server; a client cannot make one up, so a flood of
  fresh ``user`` values, or another client's ``user``, spends only its own group's share;
* the **user** is the request's ``user`` field (OpenAI's end-user id): it divides its group's
  share between that group's users, and nothing more.

Only set ``--tenant-header`` where clients reach the server through the gateway alone (or the
gateway overwrites the header): the header is taken at its word. Knows nothing about scheduling.
"""

from __future__ import annotations

from aiohttp import web

from inflight.runtime.core.fairness import SEPARATOR, tenant_name
from inflight.runtime.server.principal import key_digest, principal
from inflight.runtime.server.state import ServerSettings

MAX_GROUP_CHARS = 128  # a longer gateway tenant id is named by its digest
MAX_USER_CHARS = 128  # a longer user id is cut (users that share a prefix share a share)


def request_tenant(request: web.Request, settings: ServerSettings, user: str | None) -> str:
    """``request``'s tenant (see the module docstring). Call it after authentication."""
    group = header_group(request, settings.tenant_header) or principal(request, settings)
    return tenant_name(group, (user or "")[:MAX_USER_CHARS])


def header_group(request: web.Request, header: str | None) -> str | None:
    """The group a gateway named in ``header``, escaped so that it holds no separator (None
    when there is no such header, or it is empty)."""
    if header is None:
        return None
    value = request.headers.get(header, "").strip()
    if not value:
        return None
    if len(value) > MAX_GROUP_CHARS:
        return "sha256:" + key_digest(value)
    return value.replace("%", "%25").replace(SEPARATOR, "%2F")
