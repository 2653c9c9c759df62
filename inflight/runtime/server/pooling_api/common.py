"""What the pooling endpoints share: the body, the served pooling, running prompts, vector math.

Owns reading a pooling request's body (a JSON object; an unknown field is OpenAI's 400
"Unrecognized request argument supplied"), the pooling the engine resolved
(:class:`~inflight.runtime.model.pooling.PoolerConfig`, from the summary's ``pooler_config``),
running a batch of token-id prompts as one group of engine requests (one each; validated against
the engine first by the checks generation makes too, ``openai.prompt_checks``, so a bad one is a
400 naming the field before anything runs; fields read with ``openai.fields``) and getting their
pooled vectors back (each finished request counted in the request metrics as a generation's is), and the vector math done here rather than in the engine (Matryoshka
truncation, L2 normalization, cosine similarity, sigmoid). Also the middleware that answers a
generation endpoint on a pooling server (and /v1/score or /v1/rerank on a generating one, in the
handlers) with a 400; a generating server embeds with LAST-token pooling (``core/mixed_pooling``).
Knows nothing about the engine's scheduling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.model.pooling import PoolerConfig
from inflight.runtime.outputs import RequestRejectedError, RequestTimes
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.errors import APIError, bad_request, internal_error
from inflight.runtime.server.openai.fields import get_bool, get_str
from inflight.runtime.server.openai.generation import engine_failure
from inflight.runtime.server.openai.prompt_checks import check_fits_queue, check_prompt, rejection
from inflight.runtime.server.openai.protocol import check_model
from inflight.runtime.server.state import STATE, ServerState
from inflight.runtime.server.tenancy import request_tenant

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
# The generation endpoints a pooling server answers with a 400 (vLLM: one model, one runner).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# The engine request a pooled prompt rides as: its prompt computed, it finishes (no token sampled).
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, pooling=True)
ENGINE_NAMES = ("prompt", "max_tokens")  # the engine's names for what is the input here
# /v1/embeddings on a generating server: the last prompt token's final-normed hidden state (the engine's
# core/mixed_pooling.py, imported not here: the front end loads no torch), L2-normalized here.
GENERATE_POOLER = PoolerConfig(kind="embed", pooling_type="LAST", normalize=True)


@dataclass(frozen=True, slots=True)
class Pooled:
    """The batch's answers, in the order of its prompts."""

    vectors: list[np.ndarray]  # float32, as the engine pooled them (not normalized)
    num_prompt_tokens: int


async def read_body(request: web.Request, allowed: Sequence[str]) -> dict[str, Any]:
    """The body as a JSON object whose fields are all in ``allowed`` (``model`` checked)."""
    from inflight.runtime.server.openai.api import read_json

    state = request.app[STATE]
    body = await read_json(request, state.settings.max_body_bytes, offload=state.in_pool)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    check_model(get_str(body, "model"), state.settings.model_name)
    return body


def served_pooler(state: ServerState, endpoint: str) -> PoolerConfig:
    """The engine's pooling; on a generating server, /v1/embeddings' LAST-token pooling
    (core/mixed_pooling.py) and a 400 for the other endpoints."""
    config = state.engine.engine.config
    if config.runner == "generate" and endpoint == "/v1/embeddings":
        return GENERATE_POOLER
    if config.runner != "pooling" or config.pooler_config is None:
        raise bad_request(f"{endpoint} needs a pooling model; this server generates text (serve an embedding "
                          "model or a reranker with --runner pooling)", code="wrong_runner")
    return PoolerConfig.from_json(config.pooler_config)


def optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field (``fields.get_bool``), ``default`` when absent or null."""
    value = get_bool(body, name)
    return default if value is None else value


async def run_prompts(request: web.Request, prompts: Sequence[list[int]], param: str, prefix: str,
                      user: str | None) -> Pooled:
    """Pool ``prompts`` (token ids), one engine request each, all admitted together or none."""
    state = request.app[STATE]
    engine = state.engine.engine
    if not prompts:
        raise bad_request(f"'{param}' must not be empty", param)
    if len(prompts) > MAX_INPUTS:
        raise bad_request(f"{len(prompts)} inputs; one request may hold at most {MAX_INPUTS}", param,
                          code="too_many_inputs")
    check_fits_queue(len(prompts), engine.config, param, "inputs", "send fewer inputs", "too_many_inputs")
    request_id = state.new_request_id(prefix)
    arrival = time.monotonic()
    tenant = request_tenant(request, state.settings, user)
    requests = []
    for i, ids in enumerate(prompts):
        if len(ids) >= engine.max_model_len:  # said here in pooling's terms (its one output slot is ours)
            raise bad_request(f"input {i} of '{param}' is {len(ids)} tokens; this server takes at most "
                              f"{engine.max_model_len - 1} (set truncate_prompt_tokens to keep the last ones)",
                              param, code="prompt_too_long")
        check_prompt(engine, ids, POOLING_PARAMS, param, f"input {i} of '{param}'", ENGINE_NAMES)
        requests.append(EngineRequest(f"{request_id}-{i}", list(ids), POOLING_PARAMS, 0, arrival, tenant))
    index = {r.req_id: i for i, r in enumerate(requests)}
    vectors: list[np.ndarray | None] = [None] * len(requests)
    try:
        async with state.engine.generate(requests) as group:
            async for out in group:
                if not out.finished:
                    continue
                state.metrics.observe_finished(out, out.times or RequestTimes(arrival, finished=time.monotonic()))
                if out.pooled is None:
                    raise internal_error() if out.error is None else bad_request(out.error, param)
                vectors[index[out.req_id]] = np.frombuffer(out.pooled, dtype="<f4")
    except RequestRejectedError as exc:
        raise rejection(exc, param, ENGINE_NAMES) from None
    except APIError:
        raise
    except Exception as exc:
        raise engine_failure(exc) from None
    done = [v for v in vectors if v is not None]
    if len(done) != len(vectors):
        raise internal_error()
    return Pooled(done, sum(len(p) for p in prompts))


def finish_vector(vector: np.ndarray, pooler: PoolerConfig, dimensions: int | None) -> np.ndarray:
    """The vector a client gets: cut to ``dimensions`` (Matryoshka), then L2-normalized when the
    model's pooling normalizes (as vLLM does: truncate, then normalize)."""
    out = vector[:dimensions] if dimensions is not None else vector
    if pooler.normalize:
        out = out / max(float(np.linalg.norm(out)), 1e-12)
    return out.astype(np.float32, copy=False)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (vLLM's score for an embedding model)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / max(na * nb, 1e-12))


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


@web.middleware
async def refuse_generation(request: web.Request, handler: Any) -> web.StreamResponse:
    """A generation endpoint on a pooling server: a 400 saying which endpoints it serves."""
    if request.method == "POST" and request.path in GENERATION_PATHS:
        engine = request.app[STATE].engine
        if engine.is_ready and engine.engine.config.runner == "pooling":
            raise bad_request(f"{request.path} generates text; this server runs a pooling model (--runner pooling): "
                              "use /v1/embeddings, /v1/score or /v1/rerank", code="wrong_runner")
    return await handler(request)
