"""The benchmark suite: inflight vs static batching vs transformers' continuous batching.

``python -m inflight.bench all|burst|poisson|overhead|sweep|roofline`` (``make bench`` runs
``all``). Module map: ``client`` (streaming OpenAI client, per-request timings),
``workloads`` (seeded burst / Poisson requests), ``systems`` (start, wait for, stop a server
on 127.0.0.1), ``hf_static`` (plain ``generate`` with static batches), ``serving``
(interleaved repetitions), ``stats`` (percentiles, medians with min-max), ``report``
(markdown, PNG, JSON), ``overhead`` (time outside the forward per step), ``sweep`` (block
size x max_num_tokens), ``roofline`` (matmul rate, parameters, machine facts), ``suite`` and
``compare`` (the sections of a run), ``cli``. Results go to ``bench/results/``.
"""
