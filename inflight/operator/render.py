"""Pure manifest builders: InferenceSpec -> Deployment, Service, PDB and live-config ConfigMap.

Owns what the child objects look like. No I/O, no clock: the same spec always renders the
same dicts, so every field is checked by table-driven tests.

Live retune without a rollout: the live-tunable knobs (``LIVE_TUNABLE_FIELDS``:
maxNumSequences, maxNumTokens, maxQueueLen) are NOT written into the pod template. The
template carries constant args such as ``--max-num-sequences $(INFLIGHT_LIVE_MAX_NUM_SEQUENCES)``
and an env var that reads the value from the ``<name>-live-config`` ConfigMap
(``configMapKeyRef``); Kubernetes expands ``$(VAR)`` in args at container start. A change of
those knobs therefore only changes the ConfigMap (pods started later read the new value) and
is pushed to running ready pods through the runtime's ``POST /admin/config``; the pod
template, and so the ReplicaSet hash, is unchanged and nothing restarts. Every other knob is
a literal flag in the template, so changing it rolls the pods.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from inflight.operator import engine_args
from inflight.operator.spec import InferenceSpec
from inflight.runtime.config import LIVE_TUNABLE_FIELDS

API_GROUP = "inflight.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceDeployment"
CONTAINER_PORT = 8000
MODEL_MOUNT = "/models"
PRESTOP_SLEEP_SECONDS = 5
GRACE_MARGIN_SECONDS = 10
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 60  # 10 minutes to load a model before liveness applies
RUN_AS_USER = 1000


@dataclass(frozen=True, slots=True)
class Owner:
    """The custom resource that owns the rendered objects."""

    name: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inflight-runtime", "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    """The label selector as a string (the scale subresource's status.selector)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), "app.kubernetes.io/managed-by": "inflight-operator"}


def configmap_name(name: str) -> str:
    return f"{name}-live-config"


def endpoint_url(spec: InferenceSpec) -> str:
    return f"http://{spec.name}.{spec.namespace}.svc:{spec.service.port}/v1"


def _metadata(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": common_labels(spec.name),
        "ownerReferences": [
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def render_configmap(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    """The live knobs (snake_case keys, string values) the pods read at start."""
    meta = _metadata(spec, owner)
    meta["name"] = configmap_name(spec.name)
    values = engine_args.live_values(spec.engine)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {k: str(v) for k, v in values.items()},
    }


def runtime_args(spec: InferenceSpec) -> list[str]:
    """The runtime container's args (no live values: those come from env)."""
    model_path = MODEL_MOUNT if not spec.model.path else f"{MODEL_MOUNT}/{spec.model.path.strip('/')}"
    if spec.model.image:
        model_path = MODEL_MOUNT
    return [
        "serve",
        "--model", model_path,
        "--host", "0.0.0.0",
        "--port", str(CONTAINER_PORT),
        "--served-model-name", spec.model.served_model_name,
        "--drain-timeout", str(spec.drain_timeout_seconds),
        *engine_args.static_flags(spec.engine),
        *engine_args.live_flags(),
        *spec.extra_args,
    ]


def _env(spec: InferenceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {
            "name": engine_args.live_env_name(field),
            "valueFrom": {"configMapKeyRef": {"name": configmap_name(spec.name), "key": field}},
        }
        for field in LIVE_TUNABLE_FIELDS
    ]
    if spec.api_key_secret_ref is not None:
        ref = spec.api_key_secret_ref
        env.append(
            {"name": "INFLIGHT_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    return env


def _resources(spec: InferenceSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpus
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _container(spec: InferenceSpec) -> dict[str, Any]:
    return {
        "name": "runtime",
        "image": spec.image,
        "command": ["inflight"],
        "args": runtime_args(spec),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        "startupProbe": _probe("/ready", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": not spec.model.image},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }


def _model_volume(spec: InferenceSpec) -> dict[str, Any]:
    if spec.model.pvc_claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc_claim_name, "readOnly": True}}
    if spec.model.host_path:
        return {"name": "model", "hostPath": {"path": spec.model.host_path, "type": "Directory"}}
    return {"name": "model", "emptyDir": {}}


def _init_containers(spec: InferenceSpec) -> list[dict[str, Any]]:
    """An image that carries the weights: copy them into the shared emptyDir first."""
    if not spec.model.image:
        return []
    src = spec.model.path.rstrip("/") or "/"
    return [
        {
            "name": "model-loader",
            "image": spec.model.image,
            "command": ["sh", "-c", f'cp -a "{src}/." {MODEL_MOUNT}/'],
            "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ]


def render_pod_template(spec: InferenceSpec) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [_container(spec)],
        "volumes": [_model_volume(spec), {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if init := _init_containers(spec):
        pod_spec["initContainers"] = init
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    return {
        "metadata": {
            "labels": common_labels(spec.name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(CONTAINER_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def termination_grace_seconds(spec: InferenceSpec) -> int:
    """Longer than preStop + the runtime's drain, so scale-down never cuts a stream."""
    return PRESTOP_SLEEP_SECONDS + spec.drain_timeout_seconds + GRACE_MARGIN_SECONDS


def initial_replicas(spec: InferenceSpec) -> int:
    """Replicas on create: spec.replicas, or clamped into [min, max] when autoscaling."""
    if not spec.autoscaling.enabled:
        return spec.replicas
    return min(max(spec.replicas, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)


def render_deployment(spec: InferenceSpec, owner: Owner, replicas: int | None) -> dict[str, Any]:
    """The Deployment; ``replicas=None`` leaves spec.replicas out (the autoscaler owns it)."""
    deploy_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(spec.name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": render_pod_template(spec),
    }
    if replicas is not None:
        deploy_spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(spec, owner), "spec": deploy_spec}


def render_service(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, owner),
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(spec.name),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec.name)}},
    }


_OPTIONAL_POD_KEYS = ("initContainers", "nodeSelector", "tolerations", "affinity", "priorityClassName")


def deployment_patch(deployment: dict[str, Any], autoscaling: bool) -> dict[str, Any]:
    """The merge patch that brings an existing Deployment to ``deployment``.

    Optional pod-spec keys the spec no longer sets become ``null`` (merge patches only
    remove what is named), and with autoscaling on, ``replicas`` is left to the autoscaler.
    """
    patch = copy.deepcopy(deployment)
    if autoscaling:
        patch["spec"].pop("replicas", None)
    pod_spec = patch["spec"]["template"]["spec"]
    for key in _OPTIONAL_POD_KEYS:
        pod_spec.setdefault(key, None)
    return patch
