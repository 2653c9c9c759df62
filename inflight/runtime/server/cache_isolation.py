"""Which prefix-cache blocks a request may share: the ``cache_salt`` its engine requests carry.

A shared prefix cache answers guesses: a request whose prompt starts like another user's
finds that user's blocks cached, and its time to first token (and the hit counters) say so,
so a guess at a secret in someone's system prompt can be confirmed one candidate at a time.
The engine keys a salted request's blocks from its salt (``block_pool.salted_root``), so
only requests with the same salt share. Two ways to salt:

* the client's own ``cache_salt`` (vLLM's field; ``--prefix-cache-isolation none``, the
  default): an application that knows its users salts each user's requests;
* ``--prefix-cache-isolation key``: every request is salted with its caller's identity
  (:func:`~inflight.runtime.server.principal.principal`: the API key, or the peer address
  without keys), so callers never share blocks; a client's ``cache_salt`` then splits its
  own requests further, and never reaches another caller's blocks;
* ``--prefix-cache-isolation tenant``: as ``key``, but where a trusted gateway names the
  request's tenant in ``--tenant-header`` (:func:`~inflight.runtime.server.tenancy.header_group`),
  that tenant is the unit (callers without the header fall back to their key). Never the
  ``user`` field: a client could set another user's and share that user's blocks.

Knows nothing about block hashing beyond the salt string it hands on.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from inflight.runtime.server.principal import principal
from inflight.runtime.server.state import ServerSettings
from inflight.runtime.server.tenancy import header_group


def engine_salt(request: web.Request, settings: ServerSettings, cache_salt: str | None) -> str | None:
    """The salt ``request``'s engine requests carry, from the client's ``cache_salt`` and the
    server's isolation (see the module docstring). Under ``key`` it is ``<principal>`` or
    ``<principal>\\0<sha256 of the client's salt>`` (a principal holds no NUL, so no client
    salt can spell another caller's); under ``tenant`` ``tenant:<group>`` in place of the
    principal when the gateway named one."""
    if settings.prefix_cache_isolation == "none":
        return cache_salt
    group = header_group(request, settings.tenant_header) if settings.prefix_cache_isolation == "tenant" else None
    who = principal(request, settings) if group is None else "tenant:" + group
    if cache_salt is None:
        return who
    return who + "\0" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
