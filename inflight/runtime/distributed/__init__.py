"""Tensor and pipeline parallelism: one model split across ranks (processes, devices), on one node or several.

Map (one line per module):

* :mod:`.comm`     a rank's collectives for the model (all-reduce, logit gather) and the
                   per-step channel that carries the packed batch from rank 0 to the others.
* :mod:`.wire`     the step message's wire format, derived from the batch dataclasses' fields.
* :mod:`.launcher` rank 0's side: start the worker processes, rendezvous, supervise, stop.
* :mod:`.worker`   ``python -m inflight.runtime.distributed.worker``: ranks 1..N-1.
* :mod:`.pipeline` pipeline stages (issue 54): a rank's stage, its stage's tensor-parallel group,
                   and the point-to-point sends of activations and logits between stages.
* :mod:`.pipeline_checks` what does not combine with ``pipeline_parallel_size > 1``, and why.
* :mod:`.rendezvous` multi-node groups: rank 0's address, this node's ranks (LWS's variables as defaults).
* :mod:`.headless` ``inflight serve --headless``: a node other than 0 starts and watches its ranks.

Which heads, MLP columns and vocabulary rows each rank owns is the model's business
(:mod:`inflight.runtime.model.layout`); the per-step overhead benchmark is
:mod:`bench.studies.tensor_parallel`. This package imports :mod:`inflight.runtime.model`,
never the other way round (the model sees its collectives as the protocol
:class:`inflight.runtime.model.collectives.Collectives`, which :class:`.comm.TensorParallel` satisfies).

The scheduler, the block table and sampling live once, in rank 0 (the engine process); see
``docs/tensor-parallel.md`` for why the packed batch is broadcast rather than the scheduler
replicated.
"""
