"""``spec.nodes``: one model served by a group of pods on several nodes (the spec side).

Owns the field's parse, its CRD schema piece, and what a multi-node spec may not combine with:
the group is ``nodes`` pods of ``resources.gpus`` GPUs each, tensor parallelism inside a pod
(``tensor_parallel_size`` = gpus, as today) and one pipeline stage per pod
(``pipeline_parallel_size`` = nodes, ``with_pipeline_parallel``), the way vLLM and SGLang split a model too big for one node.
``resources`` stay per pod, so ``gpus: 8, nodes: 2`` reads "8 GPUs on each of 2 nodes".
Refused beside nodes > 1, each with a message naming the field: scale from zero (the
activator's 0 -> 1 is per pod), an InferencePool (its picker would route to the group's
headless workers), LoRA adapters (loaded per pod, not per pipeline stage), and a model cache
PVC that attaches to one node. Rendering is ``render_lws``'s; knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator import engine_args, fields

MAX_NODES = 64  # LWS has no bound; this one keeps a typo (200) from asking for 200 x 8 GPUs


def parse_nodes(spec: dict[str, Any]) -> int:
    """``spec.nodes`` (default 1: today's Deployment of independent replicas)."""
    nodes = fields.integer(spec, "nodes", 1, 1, "spec")
    if nodes > MAX_NODES:
        raise ValueError(f"spec.nodes must be at most {MAX_NODES} (got {nodes}).")
    return nodes


def check(nodes: int, *, min_replicas: int | None, pool: bool, lora: bool,
          cache_access_mode: str | None) -> None:
    """Refuse what a group of ``nodes`` pods cannot run (``ValueError`` naming the field).
    ``min_replicas``: autoscaling's minimum when autoscaling is on; ``cache_access_mode``: that
    of a cache PVC the operator creates (``None``: none)."""
    if nodes <= 1:
        return
    why = f"spec.nodes is {nodes} (one model over a group of {nodes} pods)"
    if min_replicas == 0:
        raise ValueError(f"spec.autoscaling.minReplicas 0 (scale from zero) is not supported when {why}; "
                         "set minReplicas to 1 or more.")
    if pool:
        raise ValueError(f"spec.inferencePool is not supported when {why}: the endpoint picker would see the "
                         "group's worker pods, which serve no HTTP. Route through the Service instead.")
    if lora:
        raise ValueError(f"LoRA adapters (spec.adapters, engine.enableLora) are not supported when {why}; "
                         "serve them from a single-node InferenceDeployment.")
    if cache_access_mode is not None and cache_access_mode != "ReadWriteMany":
        raise ValueError(f"spec.model.cache.accessMode is {cache_access_mode} but {why} on different nodes: "
                         "the cache PVC would attach to one node only. Use a ReadWriteMany class, an existing "
                         "shared claim (cache.claimName), or no cache.")


def with_pipeline_parallel(engine: dict[str, Any], nodes: int) -> dict[str, Any]:
    """``pipeline_parallel_size`` follows ``nodes`` (one stage per pod); an explicit value must
    equal it when nodes > 1 (with one node it is the runtime's business: stages inside a pod).
    The engine's own checks run again on the filled-in values (some options refuse stages)."""
    pp = engine.get("pipeline_parallel_size")
    if nodes <= 1:
        return engine
    if pp is not None and pp != nodes:
        raise ValueError(f"spec.engine.pipelineParallelSize ({pp}) must equal spec.nodes ({nodes}): each pod of "
                         "the group runs one pipeline stage. Leave pipelineParallelSize unset to follow nodes.")
    filled = {**engine, "pipeline_parallel_size": nodes}
    try:
        engine_args.validate_engine(filled)
    except ValueError as exc:
        raise ValueError(f"{exc} (spec.nodes: {nodes} runs pipelineParallelSize {nodes})") from exc
    return filled


def nodes_schema() -> dict[str, Any]:
    """The CRD's ``spec.nodes``; moving between one node and several in place is refused (the
    workload kind changes: Deployment <-> LeaderWorkerSet): re-create the resource."""
    return {
        "type": "integer", "minimum": 1, "maximum": MAX_NODES, "default": 1,
        "description": "Pods (nodes) one copy of the model spans: 1 (default) runs a Deployment of independent "
                       "pods; N > 1 runs a LeaderWorkerSet of groups of N pods (resources are per pod), "
                       "tensor parallel inside a pod and one pipeline stage per pod. Needs the LeaderWorkerSet "
                       "CRD (leaderworkerset.x-k8s.io). replicas and autoscaling count groups.",
        "x-kubernetes-validations": [{
            "rule": "(self > 1) == (oldSelf > 1)",
            "message": "nodes cannot move between 1 and more than 1 in place (Deployment vs LeaderWorkerSet): "
                       "delete and re-create the InferenceDeployment",
        }],
    }
