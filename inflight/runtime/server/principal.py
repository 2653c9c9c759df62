"""Who is calling: one normalised identity per authenticated caller, for every budget and share.

The identity is what the server itself checked, never a field the client may set freely:

* ``key:<digest>``: the inference key the request authenticated with (``--api-key`` or
  ``--priority-api-key``), as the first 16 hex digits of its SHA-256. The ``Authorization``
  header is parsed the way :mod:`inflight.runtime.server.auth` accepts it (the scheme in any
  case, spaces around the token), so four spellings of one key are one principal;
* ``addr:<peer>``: a server without inference keys knows callers only by their peer address
  (behind a proxy that hides peers, every keyless caller is one principal). A bearer token
  is ignored there: without a configured key any token is accepted, so a client could mint a
  fresh identity per request.

Holders of one shared key are one principal: a server that wants finer identities puts a
gateway in front that authenticates users and sets a trusted header (``--tenant-header``).
Knows nothing about what the identity is used for.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from inflight.runtime.server.state import ServerSettings


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme in any case, spaces stripped), or
    None when the header is absent, has another scheme, or carries no token."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def key_digest(token: str) -> str:
    """A short, stable, non-reversible name for a key (what logs and budgets may show)."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def principal(request: web.Request, settings: ServerSettings) -> str:
    """The caller's identity (see the module docstring). Call it after authentication, so a
    bearer token here is one the server accepted."""
    token = bearer_token(request) if (settings.api_key or settings.priority_api_key) else None
    if token is not None:
        return "key:" + key_digest(token)
    return f"addr:{request.remote or '?'}"
