"""CRD schema pieces for the model sources, the pod passthrough, the rollout and the InferencePool.

Owns the OpenAPI (structural) schema and CEL rules of those ``spec`` fields, whose defaults
are read from the spec dataclasses the parsers read them from; ``crd`` puts them together. What the schema cannot check (names the operator reserves, volumes a mount
refers to) ``pod_settings`` and ``model_source`` check and report as a Degraded condition.
Knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator import fields, partners
from inflight.operator.adapter_source import MAX_ADAPTERS, HfAdapter
from inflight.operator.model_source import ACCESS_MODES, DEFAULT_HF_PATTERNS, HfSource
from inflight.operator.pod_runtime import PROBE_KEYS
from inflight.operator.pod_settings import DEFAULT_GPU_RESOURCE, ROLLOUT_TYPES, DisruptionBudget, Rollout
from inflight.operator.pool_spec import FAILURE_MODES, InferencePoolSpec
from inflight.runtime.config_checks import MAX_KV_OFFLOADING_GIB

PRESERVE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
INT_OR_STRING = {"x-kubernetes-int-or-string": True}
# CEL bounds of the float engine fields that are not fractions in (0, 1] (crd_engine._engine_property)
NUMBER_RULES = {"kv_offloading_size": {"rule": f"self > 0.0 && self <= {float(MAX_KV_OFFLOADING_GIB)}",
                                       "message": f"must be GiB of host memory in (0, {MAX_KV_OFFLOADING_GIB}]"}}


def _str(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **extra}


def _objects(desc: str, required: list[str] | None = None) -> dict[str, Any]:
    item: dict[str, Any] = dict(PRESERVE)
    if required:
        item["required"] = required
    return {"type": "array", "description": desc, "items": item}


def hf_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "A Hugging Face Hub repo, downloaded by an init container into spec.model.cache.",
        "required": ["repoId"],
        "properties": {
            "repoId": _str("Repo id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct."),
            "revision": _str("Branch, tag or commit (pin a commit for reproducible pods).",
                             default=fields.default(HfSource, "revision")),
            "tokenSecretRef": {
                "type": "object",
                "description": "Secret holding a Hub token (gated or private repos).",
                "required": ["name"],
                "properties": {"name": _str("Secret name."), "key": _str("Key in the Secret.", default="token")},
            },
            "allowPatterns": {
                "type": "array", "items": {"type": "string"}, "minItems": 1,
                "description": f"Files to fetch (globs). Default: {', '.join(DEFAULT_HF_PATTERNS)}.",
            },
            "image": _str("Image that runs the download (default: the runtime image)."),
            "endpoint": _str("A Hub mirror's URL (HF_ENDPOINT of the download); default huggingface.co.",
                             pattern="^https?://"),
        },
    }


def cache_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Where an hf model is downloaded: an existing PVC (claimName), a PVC the operator "
                       "creates (size), or, with neither, an emptyDir per pod (every pod downloads).",
        "properties": {
            "claimName": _str("An existing PVC shared by the replicas (ReadWriteMany, or per node)."),
            "size": {**INT_OR_STRING, "description": "Create <name>-model-cache of this size, e.g. 100Gi."},
            "storageClassName": _str("StorageClass of the created PVC (one that offers ReadWriteMany to share "
                                     "the cache across nodes: Filestore, EFS, Azure Files, CephFS, NFS)."),
            "accessMode": _str("Access mode of the created PVC: ReadWriteMany with a storageClassName, else "
                               "ReadWriteOnce (default classes offer no RWX; pods on one node share it).",
                               enum=list(ACCESS_MODES)),
        },
        "x-kubernetes-validations": [
            {"rule": "!(has(self.claimName) && has(self.size))", "message": "set claimName or size, not both"}
        ],
    }


def pod_properties() -> dict[str, Any]:
    """Top-level ``spec`` fields passed through to the runtime pods."""
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "imagePullSecrets": {
            "type": "array", "description": "Secrets for pulling the runtime (and model) images.",
            "items": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        },
        "env": _objects("Extra env vars of the runtime container (core/v1 EnvVar).", ["name"]),
        "envFrom": _objects("Env from ConfigMaps/Secrets (core/v1 EnvFromSource)."),
        "volumes": _objects("Extra pod volumes (core/v1 Volume); names model, dshm, hf-home are taken.", ["name"]),
        "volumeMounts": _objects("Mounts of spec.volumes into the runtime container (not under /models or "
                                 "/dev/shm).", ["name", "mountPath"]),
        "runtimeClassName": _str("RuntimeClass of the pods (e.g. nvidia)."),
        "serviceAccountName": _str("ServiceAccount of the runtime pods (Workload Identity, IRSA)."),
        "topologySpreadConstraints": _objects("Pod topology spread constraints (core/v1).", ["maxSkew", "topologyKey"]),
        "podSecurityContext": {**PRESERVE, "description": "Replaces the pods' security context (default: UID/GID "
                               "1000, fsGroupChangePolicy OnRootMismatch, RuntimeDefault seccomp). On OpenShift "
                               "set {runAsNonRoot: true} so the SCC assigns the UID."},
        "probes": probes_schema(),
        "kernelCache": {
            "type": "object",
            "description": "A PVC for Triton's and torch inductor's compiled kernels, so restarts skip the JIT.",
            "required": ["claimName"],
            "properties": {"claimName": _str("An existing PVC (ReadWriteMany, or per node).")},
        },
        "podAnnotations": {**string_map, "description": "Extra pod annotations."},
        "podLabels": {**string_map, "description": "Extra pod labels (not the app.kubernetes.io selector keys)."},
        "rollout": rollout_schema(),
        "inferencePool": inference_pool_schema(),
        "disruptionBudget": {
            "type": "object",
            "description": "The PodDisruptionBudget: how many pods a node drain may evict at once.",
            "properties": {"maxUnavailable": {
                **INT_OR_STRING, "default": DisruptionBudget().max_unavailable,
                "description": "Pods (int, >= 1) or a percentage ('25%') a drain may take down at once; "
                               "0 is refused (it blocks every drain)."}},
        },
    }


def probes_schema() -> dict[str, Any]:
    def probe(desc: str) -> dict[str, Any]:
        ints = {k: {"type": "integer", "minimum": 0 if k == "initialDelaySeconds" else 1} for k in PROBE_KEYS}
        return {"type": "object", "description": desc, "properties": ints}

    return {
        "type": "object",
        "description": "Probe overrides. The startup budget (periodSeconds x failureThreshold, default 10 x 60 "
                       "= 10 min) must cover loading the model, the kernel JIT and NCCL init.",
        "properties": {
            "startup": probe("GET /ready until the model is loaded; liveness starts after it."),
            "liveness": probe("GET /health (default every 10 s, 3 failures restart the container)."),
            "readiness": probe("GET /ready (default every 5 s, 2 failures take the pod out of the Service)."),
        },
    }


def resources_extra() -> dict[str, Any]:
    return {
        "ephemeralStorage": {**INT_OR_STRING, "description": "ephemeral-storage request and limit, and the "
                             "sizeLimit of a per-pod model emptyDir (set it above the model's size)."},
        "shmSize": {**INT_OR_STRING, "description": "Size limit of the memory-backed /dev/shm (default: none)."},
        "gpuResourceName": _str("Extended resource the GPUs are requested as (MIG profiles, AMD: amd.com/gpu).",
                                default=DEFAULT_GPU_RESOURCE),
    }


def rollout_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "How a pod-template change rolls out. Recreate stops old pods first (a full GPU pool "
                       "cannot fit a surge pod); RollingUpdate defaults to maxSurge 1, maxUnavailable 0.",
        "properties": {
            "strategy": _str("RollingUpdate or Recreate.", default=Rollout().type, enum=list(ROLLOUT_TYPES)),
            "maxSurge": {**INT_OR_STRING, "description": "Extra pods during a RollingUpdate (int or percent)."},
            "maxUnavailable": {**INT_OR_STRING, "description": "Pods that may be down during a RollingUpdate."},
        },
        "x-kubernetes-validations": [{
            "rule": "!has(self.strategy) || self.strategy != 'Recreate' || "
                    "(!has(self.maxSurge) && !has(self.maxUnavailable))",
            "message": "maxSurge/maxUnavailable apply to RollingUpdate only",
        }],
    }


def inference_pool_schema() -> dict[str, Any]:
    d = InferencePoolSpec()
    return {
        "type": "object",
        "description": "Render an InferencePool (inference.networking.k8s.io/v1) over the runtime pods and its "
                       "endpoint picker, so a Gateway routes by prefix affinity, queue depth and KV usage.",
        "properties": {
            "enabled": {"type": "boolean", "default": d.enabled, "description": "Render the InferencePool."},
            "endpointPicker": {
                "type": "object",
                "properties": {
                    "create": {"type": "boolean", "default": d.create_picker,
                               "description": "Render the picker's Deployment and Service (<name>-epp)."},
                    "serviceName": _str("An existing picker Service (with create: false)."),
                    "image": _str(f"Endpoint picker image. Unset: the operator's (the chart's pickerImage "
                                  f"value; {d.picker_image} without the chart)."),
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535, "default": d.picker_port,
                             "description": "The picker's gRPC (ext-proc) port."},
                    "failureMode": _str("What the Gateway does when the picker does not answer.",
                                        default=d.failure_mode, enum=list(FAILURE_MODES)),
                    "serviceAccountName": _str("ServiceAccount of the picker. Unset: <name>-epp, rendered with a "
                                               "RoleBinding to the chart's picker ClusterRole (docs/kubernetes.md)."),
                    "replicas": {"type": "integer", "minimum": 1, "maximum": 5, "default": d.picker_replicas,
                                 "description": "Picker replicas; > 1 runs its leader election (one serves, the "
                                                "others stand by and take over)."},
                },
            },
        },
    }


def adapters_schema() -> dict[str, Any]:
    """``spec.adapters``: LoRA adapters loaded into the pods live (docs/operator-adapters.md)."""
    def obj(desc: str, required: list[str], props: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "description": desc, **({"required": required} if required else {}),
                "properties": props}

    source = obj("Where the adapter's PEFT files (adapter_config.json, adapter_model.safetensors) are: "
                 "exactly one of hf, pvc, image.", [], {
        "hf": obj("A Hugging Face Hub repo, downloaded by an init container (into the model cache with an hf "
                  "model and a cache PVC, else into each pod).", ["repo"], {
            "repo": _str("Repo id, e.g. org/sql-lora."),
            "revision": _str("Branch, tag or commit.", default=fields.default(HfAdapter, "revision")),
            "tokenSecret": obj("Secret holding a Hub token (gated or private repos).", ["name"], {
                "name": _str("Secret name."), "key": _str("Key in the Secret.", default="token")}),
        }),
        "pvc": obj("A PVC holding the adapter, mounted read-only under /adapters/pvc/<claimName> (adapters on a "
                   "claim already mounted are added without a restart).", ["claimName"], {
            "claimName": _str("PersistentVolumeClaim name."),
            "path": _str("The adapter's directory inside the volume.", default=""),
        }),
        "image": obj("An image holding the adapter, copied by an init container.", ["reference", "path"], {
            "reference": _str("Image reference, e.g. registry/org/sql-lora:1."),
            "path": _str("The adapter's directory inside the image (absolute)."),
        }),
    })
    source["x-kubernetes-validations"] = [{
        "rule": "[has(self.hf), has(self.pvc), has(self.image)].filter(x, x).size() == 1",
        "message": "set exactly one of hf, pvc, image"}]
    item = obj("One LoRA adapter; requests select it by name in their model field.", ["name", "source"], {
        "name": _str("The model name clients send (a DNS label; not the base model's served name).",
                     pattern=fields.DNS_LABEL.pattern, maxLength=63),
        "source": source,
    })
    return {
        "type": "array", "maxItems": MAX_ADAPTERS, "items": item,
        "description": "LoRA adapters served on the base model (turns engine.enableLora on). Added or removed "
                       "ones are loaded into / unloaded from the running pods without a rollout; new pods get "
                       "them before they are Ready (readiness gate inflight.dev/adapters-loaded).",
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
    }


def status_properties() -> dict[str, Any]:
    return {
        "adapters": {
            "type": "array",
            "description": "Per adapter: on how many of the ready pods it is loaded, and the last load error.",
            "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "loadedPods": {"type": "integer"}, "totalPods": {"type": "integer"},
                "lastError": {"type": "string"}}},
        },
        "modelCache": {
            "type": "object",
            "description": "State of the hf model download (Pending, Downloading, Ready, Failed).",
            "properties": {k: {"type": "string"} for k in ("state", "volume", "path", "message")},
        },
    }


def partner_schema() -> dict[str, Any]:
    """``spec.autoscaling.partner``: an HPA or KEDA writes the replicas from the operator's signals."""
    return {
        "type": "object", "required": ["kind"],
        "description": "Let an HPA (kind: hpa, through a metrics adapter) or a KEDA ScaledObject (kind: keda) "
                       "that the operator renders write the replicas from the signals the operator exports; the "
                       "operator keeps scraping and reporting them and never writes the replicas "
                       "(docs/operator-autoscaling-partners.md). Unset: the operator writes them.",
        "properties": {
            "kind": _str("hpa or keda.", enum=list(partners.KINDS)),
            "prometheusAddress": _str("kind: keda: the http(s) URL of the Prometheus that scrapes the operator's "
                                      "/metrics (KEDA's prometheus scaler queries it)."),
        },
        "x-kubernetes-validations": [{"rule": "self.kind != 'keda' || has(self.prometheusAddress)",
                                      "message": "prometheusAddress is required with kind: keda"}],
    }
