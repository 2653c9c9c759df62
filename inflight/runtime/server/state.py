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
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from inflight.runtime.config import DRAIN_TIMEOUT_S
from inflight.runtime.generation_defaults import SamplingDefaults
from inflight.runtime.server.compile_budget import CompileBudget
from inflight.runtime.server.engine_client import DEFAULT_MAX_BACKLOG, EngineClient
from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.server.protocol import DEFAULT_MAX_LOGPROBS, RequestPolicy
from inflight.runtime.server.tool_calls import TOOL_CALL_PARSERS, tool_parser_choices

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server knobs that are not engine knobs (those live in ``EngineConfig``).

    ``admin_api_key``: the credential for /admin (off when ``None``; ``api_key`` never grants
    it). ``engine_stall_timeout_s``: a step that has not returned by then kills the server.
    ``keepalive_timeout_s``: an idle connection, or one that has not sent a whole request
    head, is closed after this. ``request_read_timeout_s``: the most a request body may take
    to arrive (408 after). ``stream_write_timeout_s`` and ``max_stream_backlog``: a stream
    whose client does not read for that long, or lets that many outputs pile up, is cut and
    its requests aborted. ``tokenizer_workers`` / ``max_pending_tokenizations``: the pool
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
    tokenizer_workers: int = 2
    max_pending_tokenizations: int = 64
    enable_auto_tool_choice: bool | None = None
    tool_call_parser: str | None = None
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    priority_floor: int | None = None
    priority_api_key: str | None = None

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
        for name in ("max_stream_backlog", "tokenizer_workers", "max_pending_tokenizations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)}).")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the inference --api-key.")
        if self.priority_api_key is not None and self.priority_api_key in (self.api_key, self.admin_api_key):
            raise ValueError("the --priority-api-key must differ from --api-key and --admin-api-key.")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r}: {tool_parser_choices()}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for no ceiling (got {self.max_logprobs}).")

    @property
    def request_policy(self) -> RequestPolicy:
        """The defaults and limits every request is parsed with."""
        ceiling = None if self.max_logprobs == -1 else self.max_logprobs
        return RequestPolicy(self.sampling_defaults, ceiling)


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
