"""Tensor parallelism: one model split across the ranks (processes, devices) of one node.

Map (one line per module):

* :mod:`.layout`   which heads, MLP columns and vocabulary rows each rank owns (pure, no torch).
* :mod:`.comm`     a rank's collectives for the model (all-reduce, logit gather) and the
                   per-step channel that carries the packed batch from rank 0 to the others.
* :mod:`.launcher` rank 0's side: start the worker processes, rendezvous, supervise, stop.
* :mod:`.worker`   ``python -m inflight.runtime.distributed.worker``: ranks 1..N-1.
* :mod:`.bench`    per-step overhead of TP=N against TP=1 (a script, not a test).

The scheduler, the block table and sampling live once, in rank 0 (the engine process); see
``docs/tensor-parallel.md`` for why the packed batch is broadcast rather than the scheduler
replicated.
"""
