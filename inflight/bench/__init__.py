"""The benchmark suite: inflight vs static batching vs transformers' continuous batching.

``python -m inflight.bench all|burst|poisson|overhead|sweep|roofline`` (``make bench`` runs
``all``). Module map: ``client`` (streaming OpenAI client, per-request timings),
``workloads`` (seeded burst / Poisson requests), ``systems`` (start, wait for, stop a server
on 127.0.0.1), ``hf_static`` (plain ``generate`` with static batches), ``serving``
(interleaved repetitions), ``stats`` (percentiles, medians with min-max), ``report``
(markdown, PNG, JSON), ``overhead`` (time outside the forward per step), ``sweep`` (block
size x max_num_tokens), ``roofline`` (matmul rate, parameters, machine facts), ``suite`` and
``compare`` (the sections of a run), ``cli``. Results go to ``bench/results/``.

The GPU kernel benchmark lives here too, apart from the kernels it measures:
``gpu_kernels`` (``python -m inflight.bench.gpu_kernels``: checks, copy bandwidth, decode
attention bandwidth, engine step vs roofline), ``gpu_checks`` (each Triton kernel against its
reference on fresh inputs), ``gpu_engine`` (decode-step roofline arithmetic and timing) and
``compile_check`` (``python -m inflight.bench.compile_check``: Triton's ahead-of-time
compile of every kernel for a GPU target, without a GPU).

``tensor_parallel`` (``python -m inflight.bench.tensor_parallel --model DIR``) times decode
steps at TP=N against TP=1 in one process (a script, not part of ``all``).
``cpu_step`` (``python -m inflight.bench.cpu_step``) times CPU decode steps of the bench models
with kernel and weight-format variants side by side in one process, with a per-kernel profile;
``cpu_attention`` times the native decode attention alone against another build (scripts, not
part of ``all``).
"""
