"""Run one OpenAI generation request through the engine: fan out, stream or collect, account.

Owns what happens between a parsed request and its response: one engine request per
(prompt, choice) with ids ``<request id>-<choice index>``, engine-side validation (400),
admission as the request's tenant (:mod:`.tenancy`; 429 when the queue, or the tenant's share
of it, is full; 400 when the request has more choices than the queue can ever hold),
streaming chunks (each wakeup takes every queued output, merges them per choice, holds a
choice's chunk for ``stream_interval`` tokens, and writes the wakeup's events at once) or one
body, usage, metrics, the per-request JSON log line, and aborting the unfinished engine
requests when the client goes away or stops reading.
Engine failures are answered, never dropped: a request the engine failed on gets a 500 (a
stream an error event), a dead engine or a drain cut a 503. Knows nothing about routing,
auth or parsing JSON bodies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from inflight.runtime.outputs import (
    EngineFatalError,
    RequestOutput,
    RequestRejectedError,
    RequestTimes,
)
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.engine_client import (
    BacklogError,
    EngineDeadError,
    EngineRequest,
    EngineStepError,
    RequestFailedError,
    RequestsCutError,
)
from inflight.runtime.server.errors import (
    APIError,
    bad_request,
    engine_dead,
    from_rejection,
    internal_error,
    unavailable,
)
from inflight.runtime.server.openai import responses, streaming
from inflight.runtime.server.openai.chat_output import ChatOutputPlan, ChatStream
from inflight.runtime.server.openai.prompt_checks import check_fits_queue, check_prompt
from inflight.runtime.server.openai.protocol import GenerationRequest
from inflight.runtime.server.openai.responses import ChoiceState, HeldDelta, TokenText
from inflight.runtime.server.state import ServerState
from inflight.runtime.server.tenancy import request_tenant

request_log = logging.getLogger("inflight.server.requests")
logger = logging.getLogger("inflight.server")
# Prompts x n of one request: a few-KB body must not fill the whole queue (default 1024).
MAX_SEQUENCES_PER_REQUEST = 256
# The most entries one response may hold, counted before any work: over every (prompt, choice),
# max_tokens x (1 + logprobs) + prompt tokens x (1 + prompt_logprobs) when prompt logprobs (or a
# completion's echo with logprobs) are asked for; an entry is a token or one of its alternatives.
# vLLM bounds only the alternatives per position (--max-logprobs); a product of its limits (64
# prompts x n=16 x 200 tokens x 21) is a 60 KB body asking for 4.3 million entries, built and
# serialized while every other client waits. An entry is ~20-60 bytes of JSON (a chat
# top_logprobs entry ~60), so 2**21 entries keep the largest response near 40-120 MiB.
MAX_RESPONSE_ENTRIES = 2**21
INLINE_RESPONSE_TOKENS = 4096  # a non-streamed answer with more tokens is built off the event loop


Decorate = Callable[[dict[str, Any], list[ChoiceState]], None]  # echo / prompt logprobs into a body


@dataclass(slots=True)
class Job:
    """One client request on its way through the engine."""

    request_id: str
    req: GenerationRequest
    prompt_ids: list[list[int]]
    engine_requests: list[EngineRequest]
    choices: dict[str, ChoiceState]
    meta: dict[str, Any]
    token_text: TokenText | None
    arrival: float
    first_token_at: float | None = None
    outcome: str = "ok"
    output_plan: ChatOutputPlan | None = None  # chat: reasoning / tool-call parsing (None: plain text)
    chat_streams: dict[str, ChatStream] = dataclasses.field(default_factory=dict)  # per choice, when streaming
    decorate: Decorate | None = None
    renderer: streaming.Renderer | None = None  # another API's body and stream (None: OpenAI's)
    # Fixed when plan() returns; the rest changes as outputs arrive.


def plan(
    state: ServerState, req: GenerationRequest, prompt_ids: list[list[int]], prefix: str,
    output_plan: ChatOutputPlan | None = None, decorate: Decorate | None = None,
) -> Job:
    """The finished job: engine requests for every (prompt, choice), each validated against
    the engine (400 on refusal), with how its output is read (``output_plan``) and finished
    (``decorate``: echo, prompt logprobs)."""
    engine = state.engine.engine
    request_id = state.new_request_id(prefix)
    param = "messages" if req.is_chat else "prompt"
    if req.priority and engine.config.scheduler_policy not in ("priority", "fair"):
        raise bad_request(f"'priority' is only honoured with --scheduler-policy priority (or fair, within a "
                          f"tenant); this server schedules {engine.config.scheduler_policy} and would ignore it",
                          "priority")
    num_sequences = len(prompt_ids) * req.n
    if num_sequences > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"{len(prompt_ids)} prompt(s) x n={req.n} is {num_sequences} sequences; one request "
                          f"may ask for at most {MAX_SEQUENCES_PER_REQUEST}", "n" if req.n > 1 else param)
    arrival = time.monotonic()
    engine_requests, choices = [], {}
    for p_index, ids in enumerate(prompt_ids):
        for c in range(req.n):
            index = p_index * req.n + c
            params = req.params_for_choice(c)
            if ids and not req.max_tokens_given and req.is_chat:
                params = _fill_context(params, len(ids), engine.max_model_len)
            check_prompt(engine, ids, params, param, f"the {param}")
            req_id = f"{request_id}-{index}"
            engine_requests.append(EngineRequest(req_id, list(ids), params, req.priority, arrival,
                                                 cache_salt=req.cache_salt, lora_name=req.lora_name,
                                                 mm_inputs=req.mm_inputs))  # the tenant: at run()
            choices[req_id] = ChoiceState(index, req_id)
    _check_response_size(req, engine_requests)
    check_fits_queue(len(engine_requests), engine.config, "n" if req.n > 1 else param, "prompts x n",
                     "send fewer prompts or a smaller n", "too_many_choices")
    token_text = None
    if req.num_logprobs is not None:
        tokenizer = engine.tokenizer
        token_text = responses.cached_token_text(lambda tid: tokenizer.decode([tid]))
    # an adapter's requests answer with its name, as vLLM's do
    meta = {"id": request_id, "created": int(time.time()), "model": req.lora_name or state.settings.model_name}
    return Job(request_id, req, prompt_ids, engine_requests, choices, meta, token_text, arrival,
               output_plan=output_plan, decorate=decorate)


def _check_response_size(req: GenerationRequest, engine_requests: list[EngineRequest]) -> None:
    """400 naming the fields when the worst-case response holds more than
    ``MAX_RESPONSE_ENTRIES`` tokens and logprob alternatives (see the constant)."""
    out_entries = prompt_entries = num_prompt_tokens = 0
    for r in engine_requests:
        out_entries += r.params.max_tokens * (1 + (r.params.logprobs or 0))
        if r.params.prompt_logprobs is not None:
            num_prompt_tokens += len(r.prompt_token_ids)
            prompt_entries += len(r.prompt_token_ids) * (1 + r.params.prompt_logprobs)
    total = out_entries + prompt_entries
    if total <= MAX_RESPONSE_ENTRIES:
        return
    params = req.params
    k_name = "top_logprobs" if req.is_chat else "logprobs"
    what = f"max_tokens={params.max_tokens} x (1 + {k_name}={params.logprobs or 0})"
    if prompt_entries:
        pk_name = "prompt_logprobs" if req.features.prompt_logprobs is not None else "echo"
        what += f" + prompt tokens x (1 + prompt_logprobs={params.prompt_logprobs})"
        param = pk_name if prompt_entries >= out_entries else k_name if params.logprobs else "max_tokens"
    else:
        param = k_name if params.logprobs else "max_tokens"
    num_prompts = len(engine_requests) // req.n
    raise bad_request(
        f"this request could return {total:,} tokens and logprob alternatives: n={req.n} x {num_prompts} "
        f"prompt(s) x ({what}), {num_prompt_tokens:,} prompt tokens in all; one response may hold at most "
        f"{MAX_RESPONSE_ENTRIES:,}: lower n, max_tokens or the logprobs counts, or send fewer or shorter prompts",
        param, code="response_too_large")


def _fill_context(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Chat without max_tokens: the output may fill the rest of the context."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the messages encode to {num_prompt_tokens} tokens, which fills the model's context of "
            f"{max_model_len}; shorten them", "messages", code="prompt_too_long")
    try:
        return dataclasses.replace(params, max_tokens=room)
    except ValueError as exc:  # e.g. min_tokens larger than the room left
        raise bad_request(f"{exc} (max_tokens defaults to the {room} tokens left in the context)",
                          "min_tokens") from None


async def run(request: web.Request, state: ServerState, job: Job) -> web.StreamResponse:
    """Admit the job as its tenant (``server.tenancy``: the caller's key, address or gateway
    tenant, divided by ``user``; 429 when the queue or the tenant's share of it is full), then
    stream or collect its outputs."""
    tenant = request_tenant(request, state.settings, job.req.user)
    engine_requests = [dataclasses.replace(r, tenant=tenant) for r in job.engine_requests]
    try:
        async with state.engine.generate(engine_requests) as group:
            if job.req.stream:
                return await _stream(request, state, job, group)
            async for out in group:
                _record(state, job, out)
            return await _json_response(state, job)
    except RequestRejectedError as exc:
        job.outcome = "rejected"
        raise from_rejection(exc, "messages" if job.req.is_chat else "prompt") from None
    except (EngineStepError, EngineDeadError, EngineFatalError, RequestsCutError, BacklogError,
            RequestFailedError) as exc:
        job.outcome = "error"
        raise engine_failure(exc) from None
    except BaseException:
        job.outcome = "aborted" if job.outcome == "ok" else job.outcome
        raise
    finally:
        if job.outcome != "rejected":
            _count_aborted(state, job)
            _log_finished(job)


def engine_failure(exc: BaseException) -> APIError:
    """The HTTP error for a request the engine did not finish: 503 if the server is going
    away (retry elsewhere), 500 if the engine failed on it."""
    if isinstance(exc, (EngineDeadError, EngineFatalError)):
        return engine_dead(exc)
    if isinstance(exc, RequestsCutError):
        return unavailable(f"{exc}; retry on another replica", "drain_timeout")
    if isinstance(exc, BacklogError):
        return unavailable(f"the stream was cut: {exc}", "client_too_slow")
    if isinstance(exc, RequestFailedError):
        return bad_request(str(exc), None, code="constraint_failed")
    return internal_error()


def _count_aborted(state: ServerState, job: Job) -> None:
    """Choices that never finished (the client left, or the request was cut) count as aborts."""
    for choice in job.choices.values():
        if choice.finish_reason is None:
            state.metrics.observe_aborted()


async def _stream(request: web.Request, state: ServerState, job: Job, group: Any) -> web.StreamResponse:
    """Stream the job: each wakeup takes every output queued for the group, merges them per
    choice (:class:`~.responses.HeldDelta`), holds a choice's chunk until it has
    ``stream_interval`` new tokens (not its first token nor its last chunk), and writes the
    wakeup's events at once, in the job's format (OpenAI's, or its ``renderer``'s)."""
    response = await streaming.open_stream(request)
    timeout_s = state.settings.stream_write_timeout_s
    fmt = _stream_format(job)
    interval = state.settings.stream_interval
    held = {req_id: HeldDelta() for req_id in job.choices}
    try:
        sender = streaming.SseSender(request, response, timeout_s)
        opening = fmt.opening()
        if opening:
            await sender.write(opening)
        async for outs in group.batches():
            due: dict[str, HeldDelta] = {}
            now = time.monotonic()
            for out in outs:
                choice = job.choices[out.req_id]
                held[out.req_id].add(out, choice.num_chars)
                _record(state, job, out, now)
                due[out.req_id] = held[out.req_id]
            events = []
            for req_id, pending in due.items():
                if pending.is_due(interval):
                    event = _choice_event(job, job.choices[req_id], pending)
                    pending.taken(sent=event is not None)
                    if event is not None:
                        events.append(fmt.choice(event))
            events = [e for e in events if e]
            if events:
                await sender.write(events[0] if len(events) == 1 else b"".join(events))
        choices = list(job.choices.values())
        await sender.close(fmt.closing(responses.usage([len(p) for p in job.prompt_ids], choices), choices))
    except (OSError, asyncio.TimeoutError):  # the client left or stopped reading: abort the rest
        job.outcome = "aborted"
    except Exception as exc:  # the status line is sent: report in the stream, never a traceback
        if not isinstance(exc, (EngineStepError, EngineDeadError, EngineFatalError, RequestsCutError, BacklogError,
            RequestFailedError)):
            logger.exception("error while streaming %s", job.request_id)
        job.outcome = "error"
        await streaming.send_error(response, fmt.failure(engine_failure(exc)), timeout_s)
    return response


def _stream_format(job: Job) -> streaming.StreamFormat:
    if job.renderer is not None:
        return job.renderer.stream(job.meta, sum(len(p) for p in job.prompt_ids))
    indices = sorted(c.index for c in job.choices.values())
    return streaming.openai_format(job.meta, job.req.is_chat, job.req.include_usage, indices, job.req.echo_text)


def _choice_event(job: Job, choice: ChoiceState, held: HeldDelta) -> dict[str, Any] | None:
    """The streamed choice for ``held`` (one or more merged outputs); None when it says nothing
    yet (text held back, maybe a stop string, or a tool call still being parsed)."""
    text = held.text
    if not text and not held.finished and not held.logprob_parts:
        return None
    finish = held.finish_reason if held.finished else None
    if not job.req.is_chat:
        return responses.completion_delta(choice.index, text, held.logprob_parts, job.token_text, finish)
    logprobs = None
    if job.token_text is not None:
        logprobs = responses.chat_logprobs(held.logprob_entries, job.token_text)
    delta = {"content": text} if text else {}
    if job.output_plan is not None:
        stream = job.chat_streams.get(choice.req_id)
        if stream is None:
            stream = job.chat_streams[choice.req_id] = ChatStream(job.output_plan)
        delta = stream.feed(text, held.finished)
        finish = stream.finish_reason(finish)
        if not delta and not held.finished and logprobs is None:
            return None
    return responses.chat_delta(choice.index, delta, finish, logprobs)


def _record(state: ServerState, job: Job, out: RequestOutput, now: float | None = None) -> None:
    """Account one engine output: choice text, inter-token gaps, finish metrics. ``now``: when
    its batch was taken (``time.monotonic()``; read here when not given)."""
    choice = job.choices[out.req_id]
    if now is None:
        now = time.monotonic()
    if out.new_token_ids:
        if choice.last_token_at is not None:
            state.metrics.observe_token_gap(now - choice.last_token_at)
        choice.last_token_at = now
        if job.first_token_at is None:
            job.first_token_at = now
    choice.add(out)
    if out.finished:
        times = out.times or RequestTimes(arrival=job.arrival, first_token=job.first_token_at, finished=now)
        state.metrics.observe_finished(out, times, job.engine_requests[choice.index].params.max_tokens,
                                       [c for c in job.choices.values() if c.index // job.req.n == choice.index // job.req.n]
                                       if job.req.n > 1 else ())


async def _json_response(state: ServerState, job: Job) -> web.Response:
    """The non-streamed answer, built and serialized on the worker pool when it is large (many
    tokens, or any logprobs), so a big response does not hold up the event loop's other clients."""
    params = job.engine_requests[0].params if job.engine_requests else None
    tokens = sum(c.num_output_tokens for c in job.choices.values())
    if (params is None or (params.logprobs is None and params.prompt_logprobs is None)) \
            and tokens <= INLINE_RESPONSE_TOKENS:
        return web.json_response(_body(job))
    text = await state.in_pool(lambda: json.dumps(_body(job)))
    return web.Response(text=text, content_type="application/json")


def _body(job: Job) -> dict[str, Any]:
    choices = sorted(job.choices.values(), key=lambda c: c.index)
    prompt_lens = [len(p) for p in job.prompt_ids]
    if job.req.is_chat:
        body = responses.chat_body(job.meta, choices, prompt_lens, job.token_text, job.output_plan)
    else:
        body = responses.completion_body(job.meta, choices, prompt_lens, job.token_text)
    if job.decorate is not None:
        job.decorate(body, choices)
    return body if job.renderer is None else job.renderer.body(body, choices)


def _log_finished(job: Job) -> None:
    choices = sorted(job.choices.values(), key=lambda c: c.index)
    now = time.monotonic()
    reasons = [c.finish_reason or "abort" for c in choices]
    record = {
        "event": "request_finished",
        "request_id": job.request_id,
        "endpoint": job.renderer.endpoint if job.renderer is not None else
                    "chat.completions" if job.req.is_chat else "completions",
        "stream": job.req.stream,
        "num_choices": len(choices),
        "prompt_tokens": sum(len(p) for p in job.prompt_ids),
        "output_tokens": sum(c.num_output_tokens for c in choices),
        "ttft_s": None if job.first_token_at is None else round(job.first_token_at - job.arrival, 6),
        "latency_s": round(now - job.arrival, 6),
        "finish_reason": reasons[0] if len(set(reasons)) == 1 else reasons,
        "outcome": job.outcome,
        "user": job.req.user,
    }
    request_log.info(json.dumps(record))
