"""The per-app server state every handler reaches through ``request.app[STATE]``.

Owns the settings (served name, API keys, timeouts, body and buffer limits), the lifecycle
flags (loading / ready / draining / dead), the in-flight request count used for graceful
drain, the bounded worker pool that tokenizes and templates prompts off the event loop, and
references to the engine client and the metrics. No module-level mutable state: each app
gets its own ``ServerState``. Knows nothing about the OpenAI schemas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from inflight.runtime.config import DRAIN_TIMEOUT_S
from inflight.runtime.generation_defaults import SamplingDefaults
from inflight.runtime.multimodal.media import MediaLimits
from inflight.runtime.server.compile_budget import CompileBudget
from inflight.runtime.server.engine_client import DEFAULT_MAX_BACKLOG, EngineClient
from inflight.runtime.server.event_loop import EVENT_LOOPS
from inflight.runtime.server.lora import LoRAModule, check_unique
from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.server.openai.protocol import DEFAULT_MAX_LOGPROBS, RequestPolicy
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, tool_parser_choices
from inflight.runtime.server.transport import ConnectionLimits

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# none: share the prefix cache unless requests' cache_salt differs; key: never across callers;
# tenant: never across the tenants a gateway names in tenant_header (else callers).
PREFIX_CACHE_ISOLATION = ("none", "key", "tenant")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")  # RFC 9110 token, bounded
_SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server knobs that are not engine knobs (those live in ``EngineConfig``).

    ``admin_api_key``: the credential for /admin (off when ``None``; ``api_key`` never grants
    it). ``engine_stall_timeout_s``: a step that has not returned by then, or an engine that has
    answered no heartbeat for as long with no step running (frozen while idle), kills the server.
    ``keepalive_timeout_s``: an idle connection, or one that has not sent a whole request
    head, is closed after this. ``request_read_timeout_s``: the most a request body may take
    to arrive (408 after). ``stream_write_timeout_s`` and ``max_stream_backlog``: a stream
    whose client does not read for that long, or lets that many outputs pile up, is cut and
    its requests aborted. ``stream_interval``: a stream's chunk waits until it holds that many
    new tokens (its first token and its last chunk go at once), vLLM's ``--stream-interval``; a
    stream whose client or event loop falls behind sends whatever piled up in one chunk whatever
    the interval. ``api_server_count``: front-end processes serving the one port over one
    engine core (vLLM's ``--api-server-count``). ``event_loop``: each front end's event loop, ``auto``
    (uvloop where installed), ``uvloop`` or ``asyncio`` (:mod:`.event_loop`). ``tokenizer_workers`` / ``max_pending_tokenizations``: the pool
    that tokenizes prompts off the event loop and how many may wait for it (429 beyond).
    ``enable_auto_tool_choice``: ``None`` (the flag not given) and ``True`` serve ``tool_choice:
    auto``; ``False`` refuses it as vLLM does by default. ``tool_call_parser``: vLLM's name of the
    format auto calls are parsed in (``None``: the one the chat template teaches).
    ``sampling_defaults``: what requests get for the sampling fields they leave out (vLLM's
    ``--generation-config``); ``max_logprobs``: the most ``logprobs`` / ``top_logprobs`` /
    ``prompt_logprobs`` a request may ask for (-1: no ceiling but the vocabulary), vLLM's
    ``--max-logprobs``. ``priority_floor``: the lowest (most urgent) ``priority`` a request may ask
    for unless it carries ``priority_api_key`` (``None``: any; lower is served first), so that
    under the ``priority`` and ``fair`` policies only trusted callers can jump the queue;
    ``priority_api_key`` is an inference key too (accepted wherever ``api_key`` is).
    ``connection_limits``: the connection cap, the request-head byte bound and the head deadline
    (``--max-connections``, ``--max-header-bytes``, ``--max-header-count``, ``--header-timeout``).
    ``metrics_api_key``: the key ``/metrics`` answers to (with the admin key); without it,
    ``/metrics`` answers to the server's inference or admin keys when it has an inference key,
    and to anyone when it has none, or with ``open_metrics``. ``prefix_cache_isolation``:
    ``none`` (requests share prefix-cache blocks unless their ``cache_salt`` differs) or ``key``
    (each caller's requests are salted with its identity, ``principal``, so callers never share)
    or ``tenant`` (salted with the tenant ``tenant_header`` names, else as ``key``).
    ``tenant_header``: under the ``fair`` policy, the header a trusted gateway names each
    request's tenant in (``None``: the tenant is the caller's API key or address; see
    ``server.tenancy``). ``reject_unknown_fields``: a request field this server does not know is
    a 400 (OpenAI's "Unrecognized request argument supplied"); off, it is ignored, logged once per
    name and named in the ``x-inflight-ignored-fields`` response header.
    """

    model_name: str
    api_key: str | None = None
    drain_timeout_s: float = float(DRAIN_TIMEOUT_S)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_api_key: str | None = None
    engine_stall_timeout_s: float = 300.0
    keepalive_timeout_s: float = 75.0
    request_read_timeout_s: float = 60.0
    stream_write_timeout_s: float = 60.0
    max_stream_backlog: int = DEFAULT_MAX_BACKLOG
    stream_interval: int = 1
    api_server_count: int = 1
    event_loop: str = "auto"
    tokenizer_workers: int = 2
    max_pending_tokenizations: int = 64
    enable_auto_tool_choice: bool | None = None
    tool_call_parser: str | None = None
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    priority_floor: int | None = None
    priority_api_key: str | None = None
    connection_limits: ConnectionLimits = ConnectionLimits()
    metrics_api_key: str | None = None
    open_metrics: bool = False
    prefix_cache_isolation: str = "none"
    tenant_header: str | None = None
    responses_store_size: int = 0  # /v1/responses kept for previous_response_id (0: the store is off)
    reject_unknown_fields: bool = False
    media_limits: MediaLimits = MediaLimits()  # chat images: count, bytes, pixels, local files (docs/vision.md)
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules: adapters loaded before the server is ready

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string (use --served-model-name).")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain timeout must be >= 0 seconds (got {self.drain_timeout_s}).")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (got {self.max_body_bytes}).")
        for name in ("engine_stall_timeout_s", "keepalive_timeout_s", "request_read_timeout_s",
                     "stream_write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds (got {getattr(self, name)}).")
        for name in ("max_stream_backlog", "tokenizer_workers", "max_pending_tokenizations", "stream_interval",
                     "api_server_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)}).")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop {self.event_loop!r}: choose one of {', '.join(EVENT_LOOPS)}.")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the inference --api-key.")
        if self.priority_api_key is not None and self.priority_api_key in (self.api_key, self.admin_api_key):
            raise ValueError("the --priority-api-key must differ from --api-key and --admin-api-key.")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r}: {tool_parser_choices()}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for no ceiling (got {self.max_logprobs}).")
        self._check_metrics_and_isolation()
        self._check_tenant_header()
        check_unique(self.lora_modules, self.model_name)

    def _check_metrics_and_isolation(self) -> None:
        if self.metrics_api_key is not None and self.metrics_api_key in (
                self.api_key, self.priority_api_key, self.admin_api_key):
            raise ValueError("the --metrics-api-key must differ from --api-key, --priority-api-key and "
                             "--admin-api-key (the admin key is accepted on /metrics anyway).")
        if self.open_metrics and self.metrics_api_key is not None:
            raise ValueError("--open-metrics leaves /metrics open to anyone; drop it or --metrics-api-key.")
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(f"prefix_cache_isolation must be one of {', '.join(PREFIX_CACHE_ISOLATION)} "
                             f"(got {self.prefix_cache_isolation!r}).")

    def _check_tenant_header(self) -> None:
        header = self.tenant_header
        if header is None:
            return
        if not _HEADER_NAME.fullmatch(header):
            raise ValueError(f"tenant_header {header[:80]!r} is not an HTTP header name (letters, digits and "
                             "-, e.g. x-gateway-inference-fairness-id).")
        if header.lower() in _SECRET_HEADERS:
            raise ValueError(f"tenant_header {header!r} carries credentials, which must never name a tenant; "
                             "use the header your gateway sets the tenant in.")

    @property
    def request_policy(self) -> RequestPolicy:
        """The defaults and limits every request is parsed with."""
        ceiling = None if self.max_logprobs == -1 else self.max_logprobs
        return RequestPolicy(self.sampling_defaults, ceiling, self.reject_unknown_fields)


class ServerState:
    """Mutable state of one running app (touched on the event loop only)."""

    def __init__(self, settings: ServerSettings, engine: EngineClient, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.compile_budget = CompileBudget()  # each client's allowance of grammar compile time
        self.draining = False
        self.num_in_flight = 0
        self.tasks: set[asyncio.Task[object]] = set()  # handlers in flight, cancelled at drain timeout
        self.dead = asyncio.Event()  # the engine died or stalled: the process must exit
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            settings.tokenizer_workers, thread_name_prefix="inflight-tokenize")
        self.num_tokenizing = 0

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (tokenizing, templating) on the worker pool; None of it blocks the loop."""
        self.num_tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.num_tokenizing -= 1

    def close_pool(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._ids):06d}"

    def request_started(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)

    def request_finished(self) -> None:
        self.num_in_flight -= 1
        task = asyncio.current_task()
        if task is not None:
            self.tasks.discard(task)
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; false when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


STATE: web.AppKey[ServerState] = web.AppKey("inflight_state", ServerState)
