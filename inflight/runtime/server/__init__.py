"""The OpenAI-compatible HTTP server in front of the engine (aiohttp).

One line per module:

* ``app``          routes, middlewares (errors, auth, admission), /health /ready /metrics, watchdog, drain
* ``serve``        the process lifecycle: bind, load with progress, SIGTERM/SIGHUP drain, exit code
* ``auth``         the API key and admin key on every route, /metrics behind keys, Expect: 100-continue checked first
* ``engine_client`` the front end's side of the engine: request groups, dispatch, death
* ``core_client``  the protocol messages spoken to an engine core, wherever its loop runs; the text path
* ``engine_process`` the engine core in a process of its own: spawn, pipe, the front end's view of the engine
* ``engine_inproc`` the same engine core on a thread of this process (--single-process, tests)
* ``openai_api``   /v1/completions, /v1/chat/completions, /v1/models: bodies, prompts, chat template
* ``tokenize_api`` /tokenize and /detokenize
* ``request_features`` the output-shaping fields: structured outputs, template flags, echo, logprobs
* ``tool_requests`` the tools a chat request offers, forced-call schemas, tool calls in a history
* ``chat_support`` / ``chat_output`` / ``tool_calls`` / ``tool_stream`` / ``reasoning``  reading a chat reply
* ``echo``         echo and prompt logprobs in completion bodies
* ``compile_budget`` each caller's allowance of grammar compile work (429 over it), fair turns at the compilers
* ``principal``    who is calling: one normalised identity per authenticated key (or peer address)
* ``cache_isolation`` the cache_salt a request's engine requests carry (--prefix-cache-isolation)
* ``generation``   fan-out to engine requests, streaming or collecting, usage, request log, aborts
* ``protocol``     parse and validate OpenAI request bodies into ``SamplingParams`` and prompts
* ``fields``       the one set of field readers (a 400 naming the field) and the unsupported-field table
* ``prompt_checks`` the checks before prompts reach the engine, shared by generation and pooling
* ``responses``    OpenAI response bodies, stream chunks, usage and logprobs layouts
* ``streaming``    server-sent events framing
* ``errors``       the OpenAI error shape and the status / type / code of each failure
* ``metrics``      Prometheus metrics in a per-app registry
* ``admin``        GET/POST /admin/config (live retuning)
* ``state``        per-app settings and state (no module-level mutable state)
* ``transport``    the aiohttp runner: parse errors answered and logged without echo, keep-alive,
                   the connection cap, the request-head byte bound and deadline (``ConnectionLimits``)
"""

from inflight.runtime.server.app import create_app, drain
from inflight.runtime.server.serve import serve
from inflight.runtime.server.state import ServerSettings

__all__ = ["ServerSettings", "create_app", "drain", "serve"]
