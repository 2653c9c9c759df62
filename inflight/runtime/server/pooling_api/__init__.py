"""The pooling endpoints: /v1/embeddings, /v1/score and /v1/rerank (docs/embeddings.md).

A server runs one model with one runner (as vLLM does): a pooling server (``--runner pooling``,
or ``auto`` for a checkpoint with no LM head) answers these and refuses the generation
endpoints with a 400 (:func:`~.common.refuse_generation`); a generating server answers
/v1/embeddings too (its prompts' last-token hidden states, scheduled beside its chat requests:
``core/mixed_pooling``) and /v1/score and /v1/rerank with a 400. Modules: :mod:`.common` (bodies, running prompts, vector math), :mod:`.embeddings`,
:mod:`.scoring`. Knows nothing about how the engine pools.
"""

from __future__ import annotations

from aiohttp import web

from inflight.runtime.server import auth
from inflight.runtime.server.pooling_api.common import refuse_generation
from inflight.runtime.server.pooling_api.embeddings import embeddings
from inflight.runtime.server.pooling_api.scoring import rerank, score


def add_routes(app: web.Application) -> None:
    """The pooling routes, and the middleware that refuses generation on a pooling server."""
    app.middlewares.append(refuse_generation)
    app.router.add_post("/v1/embeddings", embeddings, expect_handler=auth.expect_continue)
    app.router.add_post("/v1/score", score, expect_handler=auth.expect_continue)
    app.router.add_post("/v1/rerank", rerank, expect_handler=auth.expect_continue)
