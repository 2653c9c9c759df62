"""The engine's core: requests, the scheduler and its fair share, the KV manager over the block
pool, the step (``engine.LLMEngine``) and its async pipeline, and output processing.

``request`` (a request's tokens and state), ``scheduler`` (each step's batch under the token
budget; ``sched_output`` the plain data it hands on), ``fairness`` and ``tenant_stats`` (the fair
policy), ``kv_manager`` and ``block_pool`` (paged KV with prefix caching), ``input_checks``,
``engine`` (add / abort / step; ``batch_run`` its device half), ``async_steps`` (step N+1 prepared while N runs), ``parked``,
``output_processor`` (on token ids: text and stop strings are ``engine_core``'s),
``prompt_logprobs``, ``stats_log``. Never imports
``engine_core``, ``server`` or ``cli`` (tests/test_import_graph.py).
"""
