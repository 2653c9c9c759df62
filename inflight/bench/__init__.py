"""The benchmark suite users run: inflight vs static batching vs transformers' continuous batching
vs the peers (vLLM's CPU build, llama.cpp).

``python -m inflight.bench all|burst|poisson|peers|overhead|sweep|roofline|smollm2|quant``
(``make bench`` runs ``all``, ``make bench-peers`` runs ``peers``). Module map: ``client``
(streaming OpenAI client, per-request timings), ``chat_client``, ``workloads`` (seeded burst /
Poisson requests), ``systems`` (start, wait for, stop a server on 127.0.0.1), ``run_context``
(each server's processes, threads, CPUs, load and steal), ``hf_static`` (plain ``generate`` with
static batches), ``serving`` (interleaved repetitions), ``stats`` (percentiles, medians with
min-max), ``report`` (markdown, PNG, JSON), ``overhead`` (time outside the forward per step),
``sweep`` (block size x max_num_tokens), ``roofline`` (matmul rate, parameters, machine facts),
``peers`` and ``peer_section`` (installing and comparing the peers), ``smollm2`` and
``quant_serving`` (the real model), ``suite`` and ``compare`` (the sections of a run), ``cli``.
Results go to ``bench/results/``.

One-off studies, the GPU check and the compat runners live outside the package, in the root
``bench/`` folder (not shipped in the wheel or the images); this package never imports them.
"""
