"""The OpenAI-compatible HTTP server in front of the engine (aiohttp).

One line per module:

* ``app``          routes, middlewares (errors, auth, admission), /health /ready /metrics, watchdog, drain
* ``serve``        the process lifecycle: bind, load with progress, SIGTERM drain, exit code
* ``async_engine`` the engine step loop in its own thread; command queue; death and failure handling
* ``openai_api``   /v1/completions, /v1/chat/completions, /v1/models: bodies, prompts, chat template
* ``generation``   fan-out to engine requests, streaming or collecting, usage, request log, aborts
* ``protocol``     parse and validate OpenAI request bodies into ``SamplingParams`` and prompts
* ``responses``    OpenAI response bodies, stream chunks, usage and logprobs layouts
* ``streaming``    server-sent events framing
* ``errors``       the OpenAI error shape and the status / type / code of each failure
* ``metrics``      Prometheus metrics in a per-app registry
* ``admin``        GET/POST /admin/config (live retuning)
* ``state``        per-app settings and state (no module-level mutable state)
* ``logs``         JSON log lines
* ``transport``    the aiohttp runner: parse errors answered and logged without echo, keep-alive
* ``faults``       test-only injected engine-thread death or stall (``INFLIGHT_TEST_ENGINE_FAULT``)
"""

from inflight.runtime.server.app import create_app, drain
from inflight.runtime.server.serve import serve
from inflight.runtime.server.state import ServerSettings

__all__ = ["ServerSettings", "create_app", "drain", "serve"]
