"""The emulator's request log, kept out of kmock's reaction matching.

kmock records every request in one list and finds the reaction for each new request by
iterating that whole list once per registered reaction (``request in reaction._source``
walks the root's requests through the reaction's filters), so each request cost more than
the last: at 100 InferenceDeployments the emulator stopped answering within 30 s. ``RequestLog``
(mixed into the harness's ``ApiServer``) keeps kmock's own list down to the requests being
served right now (a long watch stays there while it streams) and every request, in arrival
order, in ``sent``. Iterating the server gives ``sent`` to everyone (tests, the RBAC check, the
load study) and the in-flight requests only to kmock's matching, which runs in the task that
serves the request (marked by a context variable). Nothing here knows about Kubernetes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import Any

import aiohttp.web
import kmock

# True inside the task that serves a request: kmock's matching sees the in-flight requests only.
_SERVING: contextvars.ContextVar[bool] = contextvars.ContextVar("kmock_serving", default=False)


class _InFlight(list[Any]):
    """kmock's request list: what kmock appends is also appended to the full log."""

    def __init__(self, sent: list[kmock.Request]) -> None:
        super().__init__()
        self.sent = sent

    def append(self, request: kmock.Request) -> None:
        self.sent.append(request)
        super().append(request)


class RequestLog:
    """Mixin for a ``kmock.KubernetesEmulator`` subclass (first in the bases); call
    ``_init_log`` from ``__attrs_post_init__``."""

    sent: list[kmock.Request]  # every request, in arrival order
    _requests: list[kmock.Request]

    def _init_log(self) -> None:
        self.sent = []
        self._requests = _InFlight(self.sent)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        token = _SERVING.set(True)
        try:
            return await super().__call__(raw_request)  # type: ignore[misc]
        finally:
            _SERVING.reset(token)
            self._forget(raw_request)

    def _forget(self, raw_request: aiohttp.web.BaseRequest) -> None:
        """Drop a served request from kmock's list (which holds the in-flight ones)."""
        for index in range(len(self._requests) - 1, -1, -1):
            if self._requests[index]._raw_request is raw_request:
                del self._requests[index]
                return

    def __iter__(self) -> Iterator[Any]:
        yield from (self._requests if _SERVING.get() else self.sent)
