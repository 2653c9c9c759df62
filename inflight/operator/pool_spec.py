"""``spec.inferencePool``: the Gateway API Inference Extension wiring, parsed and validated.

Owns ``InferencePoolSpec`` (the InferencePool and its endpoint picker: create it or name an
existing one, its image, port, replicas, failure mode and ServiceAccount, and whether its
``/metrics`` asks for a token, an installation-wide choice) and the default
picker image. The picker moved from the Gateway API Inference Extension (GIE) repository into
llm-d's router (github.com/llm-d/llm-d-router; GIE keeps only the InferencePool API and the
protocol): the default is llm-d's ``llm-d-router-endpoint-picker`` image, pinned to the
release ``v0.10.0``; GIE's ``epp`` and llm-d's older ``llm-d-inference-scheduler`` images are
still accepted in ``endpointPicker.image`` (``render_pool`` speaks each one's flags). Knows
nothing about rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.operator import fields

EPP_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
FAILURE_MODES = ("FailClose", "FailOpen")
MAX_PICKER_REPLICAS = 5  # one leader serves; the rest stand by (``--ha-enable-leader-election``)


@dataclass(frozen=True, slots=True)
class InferencePoolSpec:
    """Optional Gateway API Inference Extension wiring: an InferencePool and its endpoint picker."""

    enabled: bool = False
    create_picker: bool = True  # render the endpoint picker (EPP) Deployment and Service
    picker_image: str = EPP_IMAGE
    picker_port: int = 9002
    failure_mode: str = "FailClose"
    picker_service_account: str | None = None  # None: the operator's <name>-epp when it renders RBAC
    picker_service: str | None = None  # an existing EPP Service (create_picker false)
    picker_replicas: int = 1  # > 1: leader election, one serving and the others standing by
    picker_cluster_role: str = ""  # the installation's ClusterRole for pickers ("": no RBAC rendered)
    # The picker's /metrics behind its TokenReview + SubjectAccessReview filter (its own default);
    # False: ``--metrics-endpoint-auth=false`` (the chart's pickerMetrics.auth).
    picker_metrics_auth: bool = True


def parse_inference_pool(raw: dict[str, Any], picker_image: str, picker_cluster_role: str = "",
                         picker_metrics_auth: bool = True) -> InferencePoolSpec:
    p, d = "spec.inferencePool", InferencePoolSpec()
    enabled = raw.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        raise ValueError(f"{p}.enabled must be true or false (got {enabled!r}).")
    picker = fields.obj(raw, "endpointPicker", p)
    pp = f"{p}.endpointPicker"
    create = picker.get("create", d.create_picker)
    if not isinstance(create, bool):
        raise ValueError(f"{pp}.create must be true or false (got {create!r}).")
    mode = fields.string(picker, "failureMode", d.failure_mode, pp)
    if mode not in FAILURE_MODES:
        raise ValueError(f"{pp}.failureMode must be one of {', '.join(FAILURE_MODES)} (got {mode!r}).")
    port = fields.integer(picker, "port", d.picker_port, 1, pp)
    if port > 65535:
        raise ValueError(f"{pp}.port must be <= 65535 (got {port}).")
    replicas = fields.integer(picker, "replicas", d.picker_replicas, 1, pp)
    if replicas > MAX_PICKER_REPLICAS:
        raise ValueError(f"{pp}.replicas must be <= {MAX_PICKER_REPLICAS} (got {replicas}): only the leader "
                         "serves, the others stand by.")
    service = fields.optional_string(picker, "serviceName", pp)
    if create and service is not None:
        raise ValueError(f"{pp}.serviceName names an existing picker; set create: false with it.")
    if not create and service is None:
        raise ValueError(f"{pp}.serviceName is required with create: false (the picker's Service).")
    if not create and "replicas" in picker:
        raise ValueError(f"{pp}.replicas sizes the picker the operator renders; with create: false it is yours.")
    return InferencePoolSpec(
        enabled=enabled, create_picker=create, picker_image=fields.string(picker, "image", picker_image, pp),
        picker_port=port, failure_mode=mode,
        picker_service_account=fields.optional_string(picker, "serviceAccountName", pp),
        picker_service=service, picker_replicas=replicas, picker_cluster_role=picker_cluster_role,
        picker_metrics_auth=picker_metrics_auth,
    )
