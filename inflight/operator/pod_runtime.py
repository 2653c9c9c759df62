"""How the runtime pods start, store and identify themselves: probe budgets, the kernel cache,
scratch storage, the ServiceAccount, topology spread and the pod security context.

Owns ``PodRuntime`` (parsed from ``spec.probes``, ``spec.kernelCache``,
``spec.resources.ephemeralStorage``, ``spec.serviceAccountName``,
``spec.topologySpreadConstraints`` and ``spec.podSecurityContext``) and the defaults an SRE
overrides there: a 10-minute startup budget, UID/GID 1000 with ``fsGroupChangePolicy:
OnRootMismatch`` (a 100 GB cache is not re-chowned at every start). Pure parsing and small
manifest pieces; ``render`` puts them into the pod. Knows nothing about I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from inflight.operator import fields

RUN_AS_USER = 1000
KERNEL_CACHE_VOLUME = "kernel-cache"
KERNEL_CACHE_MOUNT = "/var/cache/inflight"
KERNEL_CACHE_ENV = {  # Triton's JIT cache and torch inductor's, both on the persistent volume
    "TRITON_CACHE_DIR": f"{KERNEL_CACHE_MOUNT}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{KERNEL_CACHE_MOUNT}/inductor",
}
PROBE_KEYS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold")


@dataclass(frozen=True, slots=True)
class Probe:
    path: str
    period_seconds: int
    failure_threshold: int
    timeout_seconds: int = 5
    initial_delay_seconds: int = 0

    def render(self) -> dict[str, Any]:
        probe: dict[str, Any] = {
            "httpGet": {"path": self.path, "port": "http"},
            "periodSeconds": self.period_seconds,
            "failureThreshold": self.failure_threshold,
            "timeoutSeconds": self.timeout_seconds,
        }
        if self.initial_delay_seconds:
            probe["initialDelaySeconds"] = self.initial_delay_seconds
        return probe


# 10 s x 60 = 10 minutes to load a model before liveness applies (raise it for 70B models on
# network volumes, a cold Triton JIT or slow NCCL init: spec.probes.startup.failureThreshold).
DEFAULT_PROBES = {
    "startup": Probe("/ready", period_seconds=10, failure_threshold=60),
    "liveness": Probe("/health", period_seconds=10, failure_threshold=3),
    "readiness": Probe("/ready", period_seconds=5, failure_threshold=2),
}


# Kubernetes' own progressDeadlineSeconds default: the floor, so a short budget changes nothing.
MIN_PROGRESS_DEADLINE_SECONDS = 600
# Beyond the probes: scheduling, pulling a multi-GB image, attaching volumes, the first ready probe.
PROGRESS_MARGIN_SECONDS = 300


def startup_budget_seconds(runtime: PodRuntime) -> int:
    """How long a pod may take to load its model before the kubelet restarts it."""
    startup = runtime.probes["startup"]
    return startup.initial_delay_seconds + startup.period_seconds * startup.failure_threshold


def progress_deadline_seconds(runtime: PodRuntime) -> int:
    """The Deployment's ``progressDeadlineSeconds``: longer than a pod may take to start
    (the startup budget, a readiness round, ``PROGRESS_MARGIN_SECONDS``), so a healthy slow load
    never reports ``ProgressDeadlineExceeded``. A model download by the init container comes
    before the startup probe and is not bounded here (``status.modelCache`` shows it)."""
    ready = runtime.probes["readiness"]
    needed = startup_budget_seconds(runtime) + ready.period_seconds * ready.failure_threshold
    return max(MIN_PROGRESS_DEADLINE_SECONDS, needed + PROGRESS_MARGIN_SECONDS)


def default_pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


@dataclass(frozen=True, slots=True)
class PodRuntime:
    probes: dict[str, Probe] = field(default_factory=lambda: dict(DEFAULT_PROBES))
    kernel_cache_claim: str | None = None
    ephemeral_storage: str | None = None
    service_account_name: str | None = None
    topology_spread_constraints: tuple[dict[str, Any], ...] = ()
    pod_security_context: dict[str, Any] = field(default_factory=default_pod_security_context)


def parse_pod_runtime(spec: dict[str, Any], resources: dict[str, Any]) -> PodRuntime:
    p = "spec"
    account = fields.optional_string(spec, "serviceAccountName", p)
    if account is not None:
        fields.matching(account, fields.DNS_SUBDOMAIN, "spec.serviceAccountName", "llm-runtime")
    claim = fields.optional_string(fields.obj(spec, "kernelCache", p), "claimName", "spec.kernelCache")
    if claim is not None:
        fields.matching(claim, fields.DNS_SUBDOMAIN, "spec.kernelCache.claimName", "triton-cache")
    security = fields.obj(spec, "podSecurityContext", p)
    return PodRuntime(
        probes=_parse_probes(fields.obj(spec, "probes", p)),
        kernel_cache_claim=claim,
        ephemeral_storage=fields.quantity(resources, "ephemeralStorage", "spec.resources"),
        service_account_name=account,
        topology_spread_constraints=tuple(
            copy.deepcopy(c) for c in fields.list_of_obj(spec, "topologySpreadConstraints", p)),
        pod_security_context=copy.deepcopy(security) if "podSecurityContext" in spec else default_pod_security_context(),
    )


def _parse_probes(raw: dict[str, Any]) -> dict[str, Probe]:
    out = dict(DEFAULT_PROBES)
    unknown = sorted(set(raw) - set(DEFAULT_PROBES))
    if unknown:
        raise ValueError(f"spec.probes has unknown keys {', '.join(unknown)} (startup, liveness, readiness).")
    for name, base in DEFAULT_PROBES.items():
        over = fields.obj(raw, name, "spec.probes")
        p = f"spec.probes.{name}"
        bad = sorted(set(over) - set(PROBE_KEYS))
        if bad:
            raise ValueError(f"{p} has unknown keys {', '.join(bad)} ({', '.join(PROBE_KEYS)}).")
        out[name] = Probe(
            path=base.path,
            period_seconds=fields.integer(over, "periodSeconds", base.period_seconds, 1, p),
            failure_threshold=fields.integer(over, "failureThreshold", base.failure_threshold, 1, p),
            timeout_seconds=fields.integer(over, "timeoutSeconds", base.timeout_seconds, 1, p),
            initial_delay_seconds=fields.integer(over, "initialDelaySeconds", base.initial_delay_seconds, 0, p),
        )
    return out


def kernel_cache_volume(runtime: PodRuntime) -> list[dict[str, Any]]:
    if runtime.kernel_cache_claim is None:
        return []
    return [{"name": KERNEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": runtime.kernel_cache_claim}}]


def kernel_cache_mount(runtime: PodRuntime) -> list[dict[str, Any]]:
    return [] if runtime.kernel_cache_claim is None else [{"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_MOUNT}]


def kernel_cache_env(runtime: PodRuntime) -> list[dict[str, Any]]:
    if runtime.kernel_cache_claim is None:
        return []
    return [{"name": k, "value": v} for k, v in KERNEL_CACHE_ENV.items()]


def apply_to_pod_spec(runtime: PodRuntime, pod_spec: dict[str, Any]) -> None:
    """The pod-level fields: ServiceAccount, topology spread and the security context."""
    pod_spec["securityContext"] = copy.deepcopy(runtime.pod_security_context)
    if runtime.service_account_name:
        pod_spec["serviceAccountName"] = runtime.service_account_name
    if runtime.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [copy.deepcopy(c) for c in runtime.topology_spread_constraints]
