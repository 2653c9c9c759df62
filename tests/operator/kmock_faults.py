"""Chosen answers and mutations for the kmock harness: what a policy webhook, a quota, a busy or
dead API server, or a mutating webhook would do to a request (``Fault``, ``inject``, ``mutate``).
``kmock_api.ApiServer`` calls these first for every request it serves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kmock

Mutator = Callable[[str, dict[str, Any]], None]  # (plural, the object or merge patch written)


@dataclass
class Fault:
    """A chosen answer to chosen requests: ``method`` (POST, PATCH, GET, ...) and a part of the
    path; answered with ``status``/``reason``/``message`` (a ``Status`` object, as the API server
    writes a webhook's, a quota's or its own refusal), or never (``hang``) until the test ends.
    ``body_part``: only requests whose JSON body contains it (a webhook refusing one value).
    ``times``: how many requests it takes (None: every one); ``hits`` counts them."""

    method: str
    path_part: str
    status: int = 500
    reason: str = "InternalError"
    message: str = "Internal error occurred"
    hang: bool = False
    body_part: str = ""
    times: int | None = None
    hits: int = 0

    def matches(self, request: kmock.Request) -> bool:
        return (request.method.value == self.method and self.path_part in str(request.url.path)
                and "kmock" not in request.headers.get("User-Agent", "")
                and (not self.body_part or self.body_part in json.dumps(request.data))
                and (self.times is None or self.hits < self.times))


async def inject(faults: list[Fault], released: asyncio.Event, request: kmock.Request) -> None:
    """Raise the first matching fault's answer (or hang until ``released``); nothing if none."""
    fault = next((f for f in faults if f.matches(request)), None)
    if fault is None:
        return
    fault.hits += 1
    if fault.hang:
        await released.wait()
        raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="emulator stopping")
    raise kmock.KubernetesError(status=fault.status, reason=fault.reason, message=fault.message,
                                details={"name": request.name or "",
                                         "kind": request.resource.plural if request.resource else ""})


def mutate(mutators: list[Mutator], request: kmock.Request) -> None:
    """Run every mutating webhook on a create or update of an object (not a subresource) that
    the test itself did not send."""
    if (request.resource is None or request.subresource is not None or not isinstance(request.data, dict)
            or request.action not in (kmock.action.CREATE, kmock.action.UPDATE)
            or "kmock" in request.headers.get("User-Agent", "")):
        return
    for mutator in mutators:
        mutator(request.resource.plural, request.data)
