"""POST /v1/score (vLLM's shape) and POST /v1/rerank (Jina's and Cohere's, as vLLM serves it).

On a sequence classifier (a cross-encoder reranker: ``*ForSequenceClassification`` with one
label) each (query, document) pair is tokenized as the model's tokenizer pairs two texts
(``tokenizer(text, text_pair)``) and scored by one engine request; the score is the sigmoid of the
label's logit, as vLLM returns it (``use_activation: false``: the raw logit). On an embedding
model the query and each document are embedded and the score is their cosine similarity (as
vLLM scores with an embedding model).

``/v1/score``: ``text_1`` and ``text_2``, each a string or a list of strings: one against
many, or pairwise lists of one length; answers ``{"id", "object": "list", "created", "model",
"data": [{"index", "object": "score", "score"}], "usage"}``. ``/v1/rerank``: ``query``,
``documents`` (strings, or objects with ``text``), ``top_n`` (0 or absent: all), ``return_documents``
(default true); answers ``{"id", "model", "usage", "results": [{"index", "document": {"text"},
"relevance_score"}]}``, best first. Knows nothing about how the engine pools.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from inflight.runtime.model.pooling import PoolerConfig
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.fields import get_int, get_str
from inflight.runtime.server.pooling_api.common import (
    MAX_INPUTS,
    Pooled,
    cosine,
    finish_vector,
    optional_bool,
    read_body,
    run_prompts,
    served_pooler,
    sigmoid,
)
from inflight.runtime.server.pooling_api.embeddings import truncation
from inflight.runtime.server.state import STATE

SCORE_FIELDS = ("model", "text_1", "text_2", "user", "use_activation", "truncate_prompt_tokens",
                "add_special_tokens")  # fmt: skip
RERANK_FIELDS = ("model", "query", "documents", "top_n", "return_documents", "user", "use_activation",
                 "truncate_prompt_tokens", "add_special_tokens")  # fmt: skip


async def score(request: web.Request) -> web.Response:
    body = await read_body(request, SCORE_FIELDS)
    state = request.app[STATE]
    pooler = served_pooler(state, "/v1/score")
    firsts = _texts(body.get("text_1"), "text_1")
    seconds = _texts(body.get("text_2"), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: send one text_1, or "
                          "lists of one length", "text_2")
    scores, used = await _score_pairs(request, body, pooler, firsts, seconds, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return web.json_response({"id": state.new_request_id("score"), "object": "list", "created": int(time.time()),
                              "model": state.settings.model_name, "data": data,
                              "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}})


async def rerank(request: web.Request) -> web.Response:
    body = await read_body(request, RERANK_FIELDS)
    state = request.app[STATE]
    pooler = served_pooler(state, "/v1/rerank")
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("'query' must be a string", "query")
    documents = _documents(body.get("documents"))
    top_n = get_int(body, "top_n", 0) or 0  # 0: every document
    keep_docs = optional_bool(body, "return_documents", True)
    scores, used = await _score_pairs(request, body, pooler, [query] * len(documents), documents, "documents")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    results = []
    for i in order[: top_n or len(order)]:
        entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if keep_docs:
            entry["document"] = {"text": documents[i]}
        results.append(entry)
    return web.json_response({"id": state.new_request_id("rerank"), "model": state.settings.model_name,
                              "usage": {"prompt_tokens": used, "total_tokens": used}, "results": results})


async def _score_pairs(request: web.Request, body: dict[str, Any], pooler: PoolerConfig, firsts: list[str],
                       seconds: list[str], param: str) -> tuple[list[float], int]:
    """Each pair's score, and the prompt tokens used (see module docstring)."""
    state = request.app[STATE]
    engine = state.engine.engine
    tokenizer = engine.tokenizer
    user = get_str(body, "user")
    special = optional_bool(body, "add_special_tokens", True)
    activation = optional_bool(body, "use_activation", True)
    keep = truncation(body.get("truncate_prompt_tokens"), engine.max_model_len)

    def cut(ids: list[int]) -> list[int]:
        return ids[-keep:] if keep is not None else ids

    if pooler.kind == "score":
        def pairs() -> list[list[int]]:
            return [cut(list(tokenizer(a, b, add_special_tokens=special)["input_ids"]))
                    for a, b in zip(firsts, seconds, strict=True)]  # fmt: skip

        pooled = await run_prompts(request, await state.in_pool(pairs), param, "score", user)
        if len(pooled.vectors[0]) != 1:
            raise bad_request(f"this classifier has {len(pooled.vectors[0])} labels; scoring needs a one-label "
                              "model (a cross-encoder reranker)", code="wrong_task")
        logits = [float(v[0]) for v in pooled.vectors]
        return [sigmoid(x) if activation else x for x in logits], pooled.num_prompt_tokens
    unique = list(dict.fromkeys([*firsts, *seconds]))  # each text embedded once
    ids = await state.in_pool(lambda: [cut(tokenizer.encode(t, add_special_tokens=special)) for t in unique])
    embedded: Pooled = await run_prompts(request, ids, param, "score", user)
    vectors = {t: finish_vector(v, pooler, None) for t, v in zip(unique, embedded.vectors, strict=True)}
    return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds, strict=True)], embedded.num_prompt_tokens


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if len(value) > MAX_INPUTS:
            raise bad_request(f"'{name}' holds {len(value)} texts; at most {MAX_INPUTS}", name)
        return list(value)
    raise bad_request(f"'{name}' must be a string or a non-empty list of strings", name)


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise bad_request("'documents' must be a non-empty list of strings (or objects with 'text')", "documents")
    out = []
    for doc in value:
        if isinstance(doc, dict) and isinstance(doc.get("text"), str) and set(doc) <= {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str):
            raise bad_request("'documents' must be a non-empty list of strings (or objects with 'text')",
                              "documents")
        out.append(doc)
    if len(out) > MAX_INPUTS:
        raise bad_request(f"'documents' holds {len(out)} texts; at most {MAX_INPUTS}", "documents")
    return out
