"""Pure manifest builders: InferenceSpec -> Deployment, Service, PDB, live-config ConfigMap,
admin Secret and model-cache PVC (the model volume and init containers are ``render_model``'s,
the LoRA adapters' volumes, init containers and readiness gate ``render_adapters``', the
InferencePool and endpoint picker ``render_pool``'s).

Owns what the child objects look like, including the pod passthrough (imagePullSecrets,
env/envFrom, volumes/volumeMounts, runtimeClassName, pod labels/annotations, shm size, GPU
resource name) and the rollout strategy. No I/O, no clock: the same spec always renders the
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

import base64
import copy
from dataclasses import dataclass
from typing import Any

from inflight.operator import engine_args, pod_runtime, render_adapters, render_kv_events, render_model, render_pool
from inflight.operator.spec import METRICS_KEY_ENV, InferenceSpec, lora_enabled, passes_metrics_key
from inflight.runtime.config import LIVE_TUNABLE_FIELDS

API_GROUP = "inflight.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceDeployment"
CONTAINER_PORT = 8000
MODEL_MOUNT = render_model.MODEL_MOUNT
ADMIN_KEY = "admin-api-key"
PRESTOP_SLEEP_SECONDS = 5
GRACE_MARGIN_SECONDS = 10


@dataclass(frozen=True, slots=True)
class Owner:
    """The custom resource that owns the rendered objects (and the id of the root key its
    admin key derives from, on the pod template so pods roll when it changes)."""

    name: str
    uid: str
    admin_key_id: str = ""


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inflight-runtime", "app.kubernetes.io/instance": name}


ROLE_LABEL = "inflight.dev/role"  # "leader" | "worker": the pods of a multi-node group (``render_lws``)


def serving_labels(spec: InferenceSpec) -> dict[str, str]:
    """The labels of the pods that serve HTTP: every pod, or a group's leaders (``spec.nodes`` > 1)."""
    return {**selector_labels(spec.name), **({ROLE_LABEL: "leader"} if spec.nodes > 1 else {})}


def selector_string(name: str) -> str:
    """The label selector as a string (the scale subresource's status.selector)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), "app.kubernetes.io/managed-by": "inflight-operator"}


def configmap_name(name: str) -> str:
    return f"{name}-live-config"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


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
    return [
        "serve",
        "--model", render_model.model_path(spec.model),
        "--host", "0.0.0.0",
        "--port", str(CONTAINER_PORT),
        "--served-model-name", spec.model.served_model_name,
        "--drain-timeout", str(spec.drain_timeout_seconds),
        *engine_args.static_flags(spec.engine),
        *engine_args.live_flags(),
        *_open_metrics(spec),
        *render_kv_events.runtime_args(spec, CONTAINER_PORT),
        *spec.extra_args,
    ]


def _open_metrics(spec: InferenceSpec) -> list[str]:
    """``--open-metrics`` where the InferencePool's endpoint picker must read /metrics of pods
    that have an API key (the picker sends no key; the runtime otherwise keeps /metrics behind
    its keys). Not when the pods have a metrics key (``metricsApiKeySecretRef``, which the spec
    refuses beside a pool; ``--metrics-api-key`` in extraArgs, or its env var in ``spec.env``):
    the runtime refuses both at once."""
    metrics_keyed = spec.metrics_api_key_secret_ref is not None or passes_metrics_key(spec)
    keyed = spec.api_key_secret_ref is not None and not metrics_keyed
    return ["--open-metrics"] if spec.inference_pool.enabled and keyed else []


def _env(spec: InferenceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {
            "name": engine_args.live_env_name(field),
            "valueFrom": {"configMapKeyRef": {"name": configmap_name(spec.name), "key": field}},
        }
        for field in LIVE_TUNABLE_FIELDS
    ]
    for env_name, ref in (("INFLIGHT_API_KEY", spec.api_key_secret_ref),
                          (METRICS_KEY_ENV, spec.metrics_api_key_secret_ref)):
        if ref is not None:
            env.append({"name": env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    env.append({
        "name": "INFLIGHT_ADMIN_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": admin_secret_name(spec.name), "key": ADMIN_KEY}},
    })
    return (env + pod_runtime.kernel_cache_env(spec.runtime) + render_kv_events.runtime_env(spec)
            + [copy.deepcopy(e) for e in spec.pod.env])


def _resources(spec: InferenceSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpus:
        gpu = spec.pod.gpu_resource_name
        requests[gpu] = limits[gpu] = spec.resources.gpus
    if spec.runtime.ephemeral_storage is not None:  # the model emptyDir and the container's own writes
        requests["ephemeral-storage"] = limits["ephemeral-storage"] = spec.runtime.ephemeral_storage
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _container(spec: InferenceSpec) -> dict[str, Any]:
    container = {
        "name": "runtime",
        "image": spec.image,
        "command": ["inflight"],
        "args": runtime_args(spec),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"},
                  *render_kv_events.runtime_ports(spec)],
        "env": _env(spec),
        "resources": _resources(spec),
        "startupProbe": spec.runtime.probes["startup"].render(),
        "livenessProbe": spec.runtime.probes["liveness"].render(),
        "readinessProbe": spec.runtime.probes["readiness"].render(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "volumeMounts": [
            render_model.runtime_mount(spec.model),
            {"name": "dshm", "mountPath": "/dev/shm"},
            *pod_runtime.kernel_cache_mount(spec.runtime),
            *render_adapters.mounts(spec.adapters, spec.model),
            *(copy.deepcopy(m) for m in spec.pod.volume_mounts),
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    if spec.pod.env_from:
        container["envFrom"] = [copy.deepcopy(e) for e in spec.pod.env_from]
    return container


ADMIN_KEY_ID_ANNOTATION = "inflight.dev/admin-key-id"


def render_pod_template(spec: InferenceSpec, admin_key_id: str = "") -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [_container(spec)],
        "volumes": [
            render_model.model_volume(spec.name, spec.model, spec.runtime.ephemeral_storage),
            _shm_volume(spec),
            *render_model.extra_volumes(spec.model),
            *pod_runtime.kernel_cache_volume(spec.runtime),
            *render_adapters.volumes(spec.adapters, spec.model),
            *(copy.deepcopy(v) for v in spec.pod.volumes),
        ],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
    }
    pod_runtime.apply_to_pod_spec(spec.runtime, pod_spec)
    if init := [*render_model.init_containers(spec.model, spec.image),
                *render_adapters.init_containers(spec.adapters, spec.model, spec.image)]:
        pod_spec["initContainers"] = init
    if gates := render_adapters.readiness_gates(lora_enabled(spec)):
        pod_spec["readinessGates"] = gates
    if spec.pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    if spec.pod.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.pod.runtime_class_name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    annotations = {**spec.pod.annotations, **PROMETHEUS_ANNOTATIONS}
    if admin_key_id:
        annotations[ADMIN_KEY_ID_ANNOTATION] = admin_key_id
    return {
        "metadata": {"labels": {**spec.pod.labels, **common_labels(spec.name)}, "annotations": annotations},
        "spec": pod_spec,
    }


PROMETHEUS_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(CONTAINER_PORT),
    "prometheus.io/path": "/metrics",
}


def _shm_volume(spec: InferenceSpec) -> dict[str, Any]:
    """Memory-backed /dev/shm: multi-process (tensor-parallel) runtimes share tensors through it."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if spec.pod.shm_size is not None:
        empty_dir["sizeLimit"] = spec.pod.shm_size
    return {"name": "dshm", "emptyDir": empty_dir}


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
        "strategy": _strategy(spec),
        # Follows the startup budget: a 40-minute load must not page as ProgressDeadlineExceeded.
        "progressDeadlineSeconds": pod_runtime.progress_deadline_seconds(spec.runtime),
        "template": render_pod_template(spec, owner.admin_key_id),
    }
    if replicas is not None:
        deploy_spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(spec, owner), "spec": deploy_spec}


def _strategy(spec: InferenceSpec) -> dict[str, Any]:
    if spec.rollout.type == "Recreate":
        return {"type": "Recreate"}
    surge = {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable}
    return {"type": "RollingUpdate", "rollingUpdate": surge}


def render_admin_secret(spec: InferenceSpec, owner: Owner, key: str) -> dict[str, Any]:
    """The admin credential Secret (``admin_keys``: derived, so the operator never reads it)."""
    meta = _metadata(spec, owner)
    meta["name"] = admin_secret_name(spec.name)
    data = {ADMIN_KEY: base64.b64encode(key.encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data}


def render_cache_pvc(spec: InferenceSpec, owner: Owner) -> dict[str, Any] | None:
    return render_model.render_cache_pvc(spec.name, spec.model, _metadata(spec, owner))


def render_pool_objects(spec: InferenceSpec, owner: Owner) -> list[dict[str, Any]]:
    """InferencePool and, unless an existing picker is named, the picker's Deployment and Service
    (and its ServiceAccount and RoleBinding when the installation names the picker's ClusterRole)."""
    if not spec.inference_pool.enabled:
        return []
    objects = [render_pool.render_inference_pool(
        spec, _metadata(spec, owner), selector_labels(spec.name), CONTAINER_PORT)]
    if spec.inference_pool.create_picker:
        meta = _metadata(spec, owner)
        meta["name"] = render_pool.picker_name(spec.name)
        meta["labels"] = {**render_pool.picker_labels(spec.name), "app.kubernetes.io/managed-by": "inflight-operator"}
        objects += [render_pool.render_picker_deployment(spec, meta),
                    render_pool.render_picker_service(spec, copy.deepcopy(meta)),
                    *render_pool.render_picker_rbac(spec, copy.deepcopy(meta))]
    return objects


def render_service(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    meta = _metadata(spec, owner)
    if spec.service.annotations:  # e.g. networking.gke.io/load-balancer-type: Internal
        meta["annotations"] = dict(spec.service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.service.type,
            "selector": serving_labels(spec),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(spec: InferenceSpec, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, owner),
        "spec": {"maxUnavailable": spec.disruption_budget.max_unavailable,
                 "selector": {"matchLabels": selector_labels(spec.name)}},
    }


OPTIONAL_POD_KEYS = (
    "initContainers", "nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets",
    "runtimeClassName", "serviceAccountName", "topologySpreadConstraints", "readinessGates",
)


def deployment_patch(deployment: dict[str, Any], autoscaling: bool) -> dict[str, Any]:
    """The merge patch that brings an existing Deployment to ``deployment``.

    Optional pod-spec keys the spec no longer sets become ``null`` (merge patches only
    remove what is named), and with autoscaling on, ``replicas`` is left to the autoscaler.
    """
    patch = copy.deepcopy(deployment)
    if autoscaling:
        patch["spec"].pop("replicas", None)
    pod_spec = patch["spec"]["template"]["spec"]
    for key in OPTIONAL_POD_KEYS:
        pod_spec.setdefault(key, None)
    if patch["spec"]["strategy"]["type"] == "Recreate":
        patch["spec"]["strategy"]["rollingUpdate"] = None  # the API server refuses it with Recreate
    return patch
